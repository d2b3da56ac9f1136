"""Every ``auto`` of a config (``param_dtype``, ``rollout.dtype``, ``n_gpus_per_node``, ``fsdp_size``,
``recompute_old_log_prob``), decided once, when it
is loaded (``derive`` does it for a config built in code). Only ``auto`` values change, so resolving a
resolved config changes nothing. An unused critic's ``auto`` stays unresolved, and unsaid; so the roles
a run builds (``critic.enable`` null: whatever the estimator needs) are decided here too.
"""
from __future__ import annotations

import functools
import sys

from hybridflow import auto_cpu_layout
from hybridflow.auto_fsdp_size import Role, resolve as resolve_fsdp_sizes
from hybridflow.config.rules import rollout_correction_on

# rollout.dtype=auto: generate in the dtype the actor computes in, so vLLM's sampling log-probs and
# the trainer's agree (an fp32 trainer next to a bf16 engine, e.g. from a checkpoint saved in bf16,
# measured rollout_probs_diff_max 2-3e-3 instead of ~2e-7)
ROLLOUT_DTYPE_OF_PARAM_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def resolve(cfg):
    """Resolve every ``auto`` of an RL config (``RootConfig``) in place; returns it."""
    arr, tr = cfg.actor_rollout_ref, cfg.trainer
    use_critic = needs_critic(cfg)
    for role in (arr.actor, *([cfg.critic] if use_critic else [])):  # the reference computes as the actor
        role.param_dtype = resolve_param_dtype(role.param_dtype, tr.device)
    if arr.actor.recompute_old_log_prob == "auto":
        arr.actor.recompute_old_log_prob = "skip" if strictly_on_policy(cfg) else "always"
    if arr.rollout.dtype == "auto":  # an unknown param_dtype leaves it: validate names that one
        arr.rollout.dtype = ROLLOUT_DTYPE_OF_PARAM_DTYPE.get(arr.actor.param_dtype, "auto")
    # the workers per node before fsdp_size, which depends on them
    auto_cpu_layout.resolve(tr, auto_cpu_layout.host_cores(cfg.ray_init.num_cpus), bool(cfg.ray_init.address),
                            functools.partial(_uses_gpu, tr.device), _gpu_count,
                            functools.partial(predict_layout_step_s, cfg), say_once)
    side = tr.separate_pool_gpus_per_node if tr.placement == "separate" else tr.n_gpus_per_node
    roles = [Role("actor", arr.actor.strategy, arr.actor.fsdp_config, arr.model.path, True,
                  arr.model.lora_rank > 0, tr.n_gpus_per_node),
             Role("reference", arr.actor.strategy, arr.ref.fsdp_config, arr.model.path, False, False, side,
                  used=needs_reference(cfg))]
    if use_critic:
        roles.append(Role("critic", cfg.critic.strategy, cfg.critic.model.fsdp_config, critic_model_path(cfg),
                          True, cfg.critic.model.lora_rank > 0, side))
    resolve_fsdp_sizes(roles, functools.partial(_uses_gpu, tr.device), say_once)
    return cfg


def resolve_sft(sft):
    """The same for the SFT recipe's one model (``SFTConfig``); returns it."""
    m, tr = sft.model, sft.trainer
    m.param_dtype = resolve_param_dtype(m.param_dtype, tr.device)
    resolve_fsdp_sizes([Role("model", m.strategy, m.fsdp_config, m.path, True, m.lora_rank > 0, tr.n_gpus_per_node)],
                       functools.partial(_uses_gpu, tr.device), say_once)
    return sft


def resolve_param_dtype(value: str, device: str) -> str:
    """``auto`` -> ``bf16`` where bf16 matmuls are native on ``trainer.device`` (a GPU since Ampere;
    a CPU where a timed bf16 matmul beats fp32 by 1.5x), else ``fp32``; other values pass unchanged.
    Says once per process what it chose and why, on stderr."""
    if value != "auto":
        return value
    from hybridflow.device import auto_param_dtype  # lazy: keeps config import torch-free

    dtype, why = auto_param_dtype(_uses_gpu(device))
    say_once(f"param_dtype=auto -> {dtype}: {why}. Set it explicitly (fp32 | bf16) to choose.")
    return dtype


def _uses_gpu(device: str) -> bool:
    from hybridflow.device import uses_gpu  # lazy: keeps config import torch-free

    return uses_gpu(device)


def _gpu_count() -> int:
    from hybridflow.device import device_count

    return device_count()


def predict_layout_step_s(cfg, workers: int, threads: int) -> float:
    """The placement planner's predicted step time for ``workers`` colocated workers of ``threads``
    threads on this host: its slot calibrated at that thread count (cached), the fastest plan."""
    from hybridflow.errors import ConfigError
    from hybridflow.placement.calibrate import calibrate
    from hybridflow.placement.devices import Cluster
    from hybridflow.placement.from_config import workload_from_config
    from hybridflow.placement.planner import plan

    try:
        workload = workload_from_config(cfg)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"trainer.n_gpus_per_node=auto predicts from the model's config.json, which could not "
                          f"be read ({err}): set trainer.n_gpus_per_node explicitly") from err
    cal = calibrate(workload, threads, slots=workers)
    best = plan(workload, Cluster(cfg.trainer.nnodes, workers, cal.device), cal.planner_arg(),
                placements=("colocate",)).best
    if best is None:
        raise ConfigError(f"trainer.n_gpus_per_node=auto: no plan of {workers} worker(s) fits this host's memory: "
                          "set trainer.n_gpus_per_node explicitly")
    return best.step_s


@functools.cache
def say_once(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def needs_critic(cfg) -> bool:
    """``critic.enable`` if set, else whether the estimator uses values (gae)."""
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    return estimator_needs_critic(cfg.algorithm.adv_estimator)


def estimator_needs_critic(adv_estimator: str) -> bool:
    from hybridflow.algorithms import ADVANTAGE_ESTIMATORS  # lazy: keeps config import torch-free

    est = ADVANTAGE_ESTIMATORS.get(adv_estimator)
    return est is not None and est.needs_critic


def needs_reference(cfg) -> bool:
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def strictly_on_policy(cfg) -> bool:
    """One optimizer step per batch on weights just synced to the sampler, no KL in the reward: the
    old log-probs equal the update's own forward pass, so the separate forward can be skipped (the
    loss uses its log-probs detached, ratio 1, as TRL does)."""
    a = cfg.actor_rollout_ref.actor
    # a rollout correction weighs pi_old / pi_rollout on the controller before the update: it needs
    # the separate forward even when the update is on-policy (verl's bypass mode is not offered)
    return (a.ppo_epochs == 1 and a.ppo_mini_batch_size == cfg.data.train_batch_size
            and not cfg.algorithm.use_kl_in_reward and not rollout_correction_on(cfg.algorithm.rollout_correction)
            and not samples_off_policy(cfg))


def samples_off_policy(cfg) -> bool:
    """A rollout pool of its own that may sample with weights older than the trainer's
    (``async_training``), or pi_old taken from the rollout (:func:`bypass_old_log_prob`): the update
    needs pi_old as a tensor."""
    at = cfg.async_training
    return bypass_old_log_prob(cfg) or not cfg.actor_rollout_ref.hybrid_engine and (
        at.staleness_threshold > 0 or at.trigger_parameter_sync_step > 1)


def bypass_old_log_prob(cfg) -> bool:
    """pi_old is the rollout's own log-probs, no trainer forward: verl's
    ``algorithm.rollout_correction.bypass_mode``, or ``async_training.use_rollout_log_probs`` with a
    rollout pool of its own (the same thing under verl's fully-async name)."""
    return cfg.algorithm.rollout_correction.bypass_mode or (
        not cfg.actor_rollout_ref.hybrid_engine and cfg.async_training.use_rollout_log_probs)


def critic_model_path(cfg) -> str:
    """``critic.model.path``, or the actor's when null (a fresh value head on the actor's model)."""
    return cfg.critic.model.path or cfg.actor_rollout_ref.model.path
