"""Typed configuration of a hybridflow run (verl's key tree), loaded from Hydra and validated
before any worker starts.

    cfg = load_config(hydra_cfg)          # unknown keys / wrong types -> ConfigError
    validate(cfg, available_slots=4)      # sizes, names, files, devices -> ConfigError
    d = derive(cfg, dataset_len=len(ds))  # dp sizes, mini-batches per step, total steps
"""
from hybridflow.config.actor_rollout_ref import (
    ActorConfig, ActorRolloutRefConfig, ModelConfig, RefConfig, RolloutConfig, ValKwargsConfig,
)
from hybridflow.config.algorithm import AlgorithmConfig, KLCtrlConfig
from hybridflow.config.common import MegatronConfig, OptimConfig
from hybridflow.config.critic import CriticConfig, CriticModelConfig
from hybridflow.config.data import DataConfig
from hybridflow.config.derived import Derived, derive, needs_critic, needs_reference
from hybridflow.config.errors import ConfigError
from hybridflow.config.keys import dotted_keys
from hybridflow.config.load import load_config, to_dataclass
from hybridflow.model_checks import read_model_config
from hybridflow.config.reward import CustomRewardFunctionConfig, RewardModelConfig, RewardModelModelConfig
from hybridflow.config.root import RootConfig
from hybridflow.config.trainer import RayInitConfig, TrainerConfig
from hybridflow.config.validate import validate

__all__ = [
    "ActorConfig", "ActorRolloutRefConfig", "ModelConfig", "RefConfig", "RolloutConfig",
    "ValKwargsConfig", "AlgorithmConfig", "KLCtrlConfig", "MegatronConfig", "OptimConfig",
    "CriticConfig", "CriticModelConfig", "DataConfig", "Derived", "derive", "needs_critic", "needs_reference",
    "ConfigError", "dotted_keys", "load_config", "to_dataclass",
    "CustomRewardFunctionConfig", "RewardModelConfig", "RewardModelModelConfig", "RootConfig",
    "RayInitConfig", "TrainerConfig", "read_model_config", "validate",
]
