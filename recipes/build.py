"""Bind the roles of a validated config to worker classes (the recipe's job; the core never
imports ``workers``) and build everything a run needs before the loop starts."""
from __future__ import annotations

from hybridflow.algorithms.objectives import ActorObjective
from hybridflow.config import read_model_config
from hybridflow.config.derived import critic_external_lib, reward_model_external_lib
from hybridflow.config.resolve import critic_model_path
from hybridflow.controller import RayClassWithInitArgs
from recipes.engine_settings import (
    actor_engine_kwargs, critic_engine_kwargs, ref_engine_kwargs, rollout_engine_kwargs,
)
from workers.actor_rollout_ref import ActorRolloutRefSettings, ActorRolloutRefWorker
from workers.critic import CriticSettings, CriticWorker
from workers.engines.config import EngineConfig
from workers.reward_model import RewardModelSettings, RewardModelWorker
from workers.rollout.base import RolloutConfig
from workers.rollout_worker import RolloutWorker, RolloutWorkerSettings


def actor_settings(cfg, derived, roles) -> ActorRolloutRefSettings:
    arr = cfg.actor_rollout_ref
    a = arr.actor
    return ActorRolloutRefSettings(
        model_path=arr.model.path, roles=tuple(roles), actor=EngineConfig(**actor_engine_kwargs(cfg, derived)),
        ref=EngineConfig(**ref_engine_kwargs(cfg, derived)), rollout=RolloutConfig(**rollout_engine_kwargs(cfg)),
        objective=ActorObjective.from_section(a),
        ppo_mini_batch_size=a.ppo_mini_batch_size * arr.rollout.n, ppo_epochs=a.ppo_epochs, shuffle=a.shuffle,
        temperature=arr.rollout.temperature, seed=cfg.trainer.seed,
        reshard_bucket_bytes=arr.rollout.update_weights_bucket_megabytes << 20, external_lib=arr.model.external_lib)


def role_specs(cfg, derived) -> tuple[dict, dict]:
    """(main-pool roles, side roles) as RayClassWithInitArgs, keyed by the trainer's role names."""
    separate, hybrid = cfg.trainer.placement == "separate", cfg.actor_rollout_ref.hybrid_engine
    actor_roles = ["actor"] + (["rollout"] if hybrid else []) + (["ref"] if derived.use_reference and not separate
                                                                 else [])
    main = {"actor_rollout_ref": RayClassWithInitArgs(ActorRolloutRefWorker, actor_settings(cfg, derived, actor_roles))}
    side = {}
    if not hybrid:  # the rollout's own pool (hybridflow/trainer/placement.py)
        side["rollout"] = RayClassWithInitArgs(RolloutWorker, RolloutWorkerSettings(
            model_path=cfg.actor_rollout_ref.model.path, rollout=RolloutConfig(**rollout_engine_kwargs(cfg)),
            seed=cfg.trainer.seed, external_lib=cfg.actor_rollout_ref.model.external_lib))
    if derived.use_reference and separate:
        side["ref"] = RayClassWithInitArgs(ActorRolloutRefWorker, actor_settings(cfg, derived, ["ref"]))
    if derived.use_critic:
        c = cfg.critic
        side["critic"] = RayClassWithInitArgs(CriticWorker, CriticSettings(
            model_path=critic_model_path(cfg), engine=EngineConfig(**critic_engine_kwargs(cfg, derived)),
            ppo_mini_batch_size=derived.critic_mini_batch_size * cfg.actor_rollout_ref.rollout.n,
            ppo_epochs=derived.critic_ppo_epochs, cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode,
            seed=cfg.trainer.seed, external_lib=critic_external_lib(cfg)))
    if cfg.reward_model.enable:
        side["reward_model"] = RayClassWithInitArgs(RewardModelWorker, RewardModelSettings(
            model_path=cfg.reward_model.model.path, micro_batch_size_per_gpu=cfg.reward_model.micro_batch_size_per_gpu,
            # the worker refuses a reward model whose vocabulary is not the actor's (ids would not match)
            actor_vocab_size=(read_model_config(cfg.actor_rollout_ref.model.path) or {}).get("vocab_size"),
            external_lib=reward_model_external_lib(cfg)))
    return main, side
