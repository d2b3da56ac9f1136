"""The whole run's configuration: one dataclass per top-level Hydra node, verl's tree."""
from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.config.actor_rollout_ref import ActorRolloutRefConfig
from hybridflow.config.algorithm import AlgorithmConfig
from hybridflow.config.critic import CriticConfig
from hybridflow.config.data import DataConfig
from hybridflow.config.reward import CustomRewardFunctionConfig, RewardModelConfig
from hybridflow.config.trainer import RayInitConfig, RayKwargsConfig, TrainerConfig


@dataclass
class RootConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(
        default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)
