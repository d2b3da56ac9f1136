"""The whole run's configuration: one dataclass per top-level Hydra node, verl's tree."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hybridflow.config.actor_rollout_ref import ActorRolloutRefConfig
from hybridflow.config.algorithm import AlgorithmConfig
from hybridflow.config.async_training import AsyncTrainingConfig, RolloutPoolConfig
from hybridflow.config.critic import CriticConfig
from hybridflow.config.data import DataConfig
from hybridflow.config.keys import key
from hybridflow.config.stage_fusion import StageFusionConfig
from hybridflow.config.reward import CustomRewardFunctionConfig, RewardModelConfig
from hybridflow.config.trainer import RayInitConfig, RayKwargsConfig, TrainerConfig
from hybridflow.verl_compat import INERT_KEYS


@dataclass
class RootConfig:
    verl_inert_keys: ClassVar[dict] = INERT_KEYS
    data: DataConfig = key(DataConfig(), "the prompt data set and one step's batch shape")
    actor_rollout_ref: ActorRolloutRefConfig = key(ActorRolloutRefConfig(), "the policy: model, training, "
                                                                            "generation, reference")
    critic: CriticConfig = key(CriticConfig(), "the value model (gae)")
    reward_model: RewardModelConfig = key(RewardModelConfig(), "reward model and reward manager")
    custom_reward_function: CustomRewardFunctionConfig = key(CustomRewardFunctionConfig(), "a user's reward function")
    algorithm: AlgorithmConfig = key(AlgorithmConfig(), "advantages and KL")
    rollout: RolloutPoolConfig = key(RolloutPoolConfig(), "hybrid_engine=false: the rollout pool's slots")
    async_training: AsyncTrainingConfig = key(AsyncTrainingConfig(), "hybrid_engine=false: how far generation "
                                                                      "runs ahead of training")
    stage_fusion: StageFusionConfig = key(StageFusionConfig(), "RLHFuse's stage fusion: streaming generation "
                                                               "into inference, tail migration, fused updates")
    trainer: TrainerConfig = key(TrainerConfig(), "the loop, outputs and resources")
    ray_init: RayInitConfig = key(RayInitConfig(), "Ray's start")
    ray_kwargs: RayKwargsConfig = key(RayKwargsConfig(), "verl's newer layout of ray_init")
