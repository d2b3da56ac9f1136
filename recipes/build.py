"""Bind the roles of a validated config to worker classes (the recipe's job; the core never
imports ``workers``) and build everything a run needs before the loop starts."""
from __future__ import annotations

from hybridflow.algorithms.objectives import ActorObjective
from hybridflow.config import actor_engine_kwargs, critic_engine_kwargs, read_model_config, rollout_engine_kwargs
from hybridflow.config.derived import (
    critic_external_lib, log_prob_token_budget, offload_kwargs, reward_model_external_lib,
)
from hybridflow.controller import RayClassWithInitArgs
from workers.actor_rollout_ref import ActorRolloutRefSettings, ActorRolloutRefWorker
from workers.critic import CriticSettings, CriticWorker
from workers.engines.config import EngineConfig
from workers.reward_model import RewardModelSettings, RewardModelWorker
from workers.rollout.base import RolloutConfig


def actor_settings(cfg, derived, roles) -> ActorRolloutRefSettings:
    arr, n = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout.n
    a = arr.actor
    engine = EngineConfig(**actor_engine_kwargs(cfg, derived))
    ref = EngineConfig(**{**actor_engine_kwargs(cfg, derived),
                          "micro_batch_size_per_gpu": arr.ref.log_prob_micro_batch_size_per_gpu,
                          "infer_micro_batch_size_per_gpu": arr.ref.log_prob_micro_batch_size_per_gpu,
                          "infer_max_token_len_per_gpu": log_prob_token_budget(cfg, arr.ref),
                          "fsdp_size": arr.ref.fsdp_config.fsdp_size,
                          "forward_prefetch": arr.ref.fsdp_config.forward_prefetch,
                          "reshard_after_forward": arr.ref.fsdp_config.reshard_after_forward,
                          # the base model; colocated with a LoRA actor the worker uses the actor's
                          # engine with its adapters off instead of this one
                          "lora_rank": 0,
                          **offload_kwargs(a.strategy, arr.ref.fsdp_config, arr.ref.megatron)})
    objective = ActorObjective(policy_loss=a.policy_loss.loss_mode,
                               clip_ratio=a.clip_ratio, clip_ratio_low=a.clip_ratio_low,
                               clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
                               entropy_coeff=a.entropy_coeff, use_kl_loss=a.use_kl_loss,
                               kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type,
                               loss_agg_mode=a.loss_agg_mode, skip_zero_advantage=a.skip_zero_advantage)
    return ActorRolloutRefSettings(
        model_path=arr.model.path, roles=tuple(roles), actor=engine, ref=ref,
        rollout=RolloutConfig(**rollout_engine_kwargs(cfg)), objective=objective,
        ppo_mini_batch_size=a.ppo_mini_batch_size * n, ppo_epochs=a.ppo_epochs, shuffle=a.shuffle,
        temperature=arr.rollout.temperature, seed=cfg.trainer.seed,
        reshard_bucket_bytes=arr.rollout.update_weights_bucket_megabytes << 20, external_lib=arr.model.external_lib)


def role_specs(cfg, derived) -> tuple[dict, dict]:
    """(main-pool roles, side roles) as RayClassWithInitArgs, keyed by the trainer's role names."""
    separate = cfg.trainer.placement == "separate"
    actor_roles = ["actor", "rollout"] + (["ref"] if derived.use_reference and not separate else [])
    main = {"actor_rollout_ref": RayClassWithInitArgs(ActorRolloutRefWorker, actor_settings(cfg, derived, actor_roles))}
    side = {}
    if derived.use_reference and separate:
        side["ref"] = RayClassWithInitArgs(ActorRolloutRefWorker, actor_settings(cfg, derived, ["ref"]))
    if derived.use_critic:
        c, n = cfg.critic, cfg.actor_rollout_ref.rollout.n
        side["critic"] = RayClassWithInitArgs(CriticWorker, CriticSettings(
            model_path=c.model.path or cfg.actor_rollout_ref.model.path,
            engine=EngineConfig(**critic_engine_kwargs(cfg, derived)),
            ppo_mini_batch_size=derived.critic_mini_batch_size * n,
            ppo_epochs=c.ppo_epochs or cfg.actor_rollout_ref.actor.ppo_epochs,
            cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode, seed=cfg.trainer.seed,
            external_lib=critic_external_lib(cfg)))
    if cfg.reward_model.enable:
        side["reward_model"] = RayClassWithInitArgs(RewardModelWorker, RewardModelSettings(
            model_path=cfg.reward_model.model.path, micro_batch_size_per_gpu=cfg.reward_model.micro_batch_size_per_gpu,
            # the worker refuses a reward model whose vocabulary is not the actor's (ids would not match)
            actor_vocab_size=(read_model_config(cfg.actor_rollout_ref.model.path) or {}).get("vocab_size"),
            external_lib=reward_model_external_lib(cfg)))
    return main, side
