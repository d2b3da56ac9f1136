"""Rules of single config sections (generation, DAPO's length penalty, checkpoint contents, LoRA,
fsdp_size) and the message helpers the RL and SFT validations share. Each message names the key
and the fix, as everywhere in ``validate``."""
from __future__ import annotations

import difflib
from typing import Any

from hybridflow.config.common import CHECKPOINT_CONTENTS
from hybridflow.config.keys import ARR


def unknown_name(key: str, value: Any, allowed) -> str:
    allowed = list(allowed)
    close = difflib.get_close_matches(str(value), allowed, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"{key}={value!r} is unknown{hint}: use one of {', '.join(allowed)}"


def fsdp_size_error(prefix: str, strategy: str, size: int, world: int) -> str | None:
    key = f"{prefix}.fsdp_config.fsdp_size"
    if size in (-1, "auto"):  # auto: resolved by load_config (hybridflow/auto_fsdp_size.py)
        return None
    if isinstance(size, str):
        return (f"{key}={size!r} is not a size: use auto, -1 (shard over all workers), 1 (replicate) or a "
                f"divisor of {world}")
    if strategy != "fsdp":
        return f"{key}={size} only applies to strategy=fsdp (it is {strategy}): leave it at -1"
    if size < 1 or world % size:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        return (f"{key}={size} must be -1 (shard over all {world} workers), 1 (replicate) or a divisor of "
                f"{world}: use one of {[-1] + divisors}")
    return None


def lora_strategy_errors(section: str, rank: int, strategy_key: str, strategy: str) -> list[str]:
    if rank and strategy != "fsdp":
        return [f"{section}.lora_rank={rank}: LoRA adapters are implemented for {strategy_key}=fsdp; set it, "
                f"or lora_rank=0 with {strategy}"]
    return []


# verl's load formats: its dummy_* family (random init; the weight sync fills the engine before its
# first generation) is vLLM's "dummy"; the others are vLLM's names for reading a local checkpoint
ROLLOUT_LOAD_FORMATS = ("auto", "hf", "safetensors", "pt", "npcache",
                        "dummy", "dummy_dtensor", "dummy_hf", "dummy_megatron")
# vLLM LLM(...) arguments hybridflow sets itself: the hybridflow key that sets each (most are
# rollout keys of vLLM's own name)
_VLLM_NAMED_ROLLOUT_KEYS = ("dtype", "enforce_eager", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                            "enable_chunked_prefill", "enable_prefix_caching", "disable_log_stats", "load_format",
                            "gpu_memory_utilization")
VLLM_KWARGS_FROM_KEYS = {
    **{name: f"{ARR}.rollout.{name}" for name in _VLLM_NAMED_ROLLOUT_KEYS},
    "model": f"{ARR}.model.path",
    "tensor_parallel_size": f"{ARR}.rollout.tensor_model_parallel_size",
    "seed": "trainer.seed",
    "kv_cache_memory_bytes": f"{ARR}.rollout.kv_cache_gib",
    "enable_sleep_mode": f"{ARR}.rollout.free_cache_engine",
    "hf_overrides": f"{ARR}.model.override_config",  # the training engines apply it too
    "speculative_config": f"{ARR}.rollout.speculative",  # the adaptive drafts and history drafter sit on it
}
# ... and those no key changes, because the rollout relies on them
VLLM_KWARGS_FIXED = {
    "distributed_executor_backend": "vLLM runs inside the worker group's torch.distributed world",
    "skip_tokenizer_init": "prompts go in as token ids",
    "logprobs_mode": "rollout log-probs are those of the distribution each token was sampled from",
}


def rollout_errors(cfg) -> list[str]:
    """The generation keys' rules (sampling, context length, loading, vLLM's constructor and
    scheduler), checked here so they fail before any worker starts."""
    r, errors = cfg.actor_rollout_ref.rollout, []
    key = f"{ARR}.rollout"
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    for name, data_key in (("prompt_length", "max_prompt_length"), ("response_length", "max_response_length")):
        value, wanted = getattr(r, name), getattr(cfg.data, data_key)
        if value is not None and value != wanted:
            errors.append(f"{key}.{name}={value} differs from data.{data_key}={wanted}: hybridflow reads the data "
                          f"key; set data.{data_key}={value} (and {key}.{name}=null or the same)")
    if not r.do_sample and r.n > 1:
        errors.append(f"{key}.n={r.n} with {key}.do_sample=false repeats one greedy response: set "
                      f"{key}.n=1 or {key}.do_sample=true")
    if r.max_model_len is not None and r.max_model_len < longest:
        errors.append(f"{key}.max_model_len={r.max_model_len} cannot hold data.max_prompt_length + "
                      f"data.max_response_length = {longest} tokens: raise it to >= {longest} or set it to "
                      "null (that sum)")
    if r.load_format not in ROLLOUT_LOAD_FORMATS:
        errors.append(f"{key}.load_format={r.load_format!r} is unknown: use one of {', '.join(ROLLOUT_LOAD_FORMATS)}")
    errors += _vllm_kwargs_errors(r)
    if r.name == "vllm":
        errors += _scheduler_errors(r, r.max_model_len or longest)
    return errors


def _vllm_kwargs_errors(r) -> list[str]:
    """engine_kwargs.vllm goes to vLLM's constructor as is: only for vLLM, and never over an
    argument hybridflow sets itself (its key says so, and the rollout depends on the fixed ones)."""
    key = f"{ARR}.rollout.engine_kwargs.vllm"
    extra = r.engine_kwargs.vllm
    if extra and r.name != "vllm":
        return [f"{key}={extra} is passed to vLLM, but {ARR}.rollout.name={r.name}: remove it or set "
                f"{ARR}.rollout.name=vllm"]
    errors = []
    for name in extra:
        if name in VLLM_KWARGS_FROM_KEYS:
            errors.append(f"{key}.{name} is set by hybridflow from {VLLM_KWARGS_FROM_KEYS[name]}: "
                          "remove it here and set that key instead")
        elif name in VLLM_KWARGS_FIXED:
            errors.append(f"{key}.{name} is fixed by hybridflow ({VLLM_KWARGS_FIXED[name]}): remove it")
    return errors


def _scheduler_errors(r, context: int) -> list[str]:
    """vLLM's scheduler rules for max_num_batched_tokens, against the engine's context length."""
    tokens, key, errors = r.max_num_batched_tokens, f"{ARR}.rollout.max_num_batched_tokens", []
    if tokens is None:
        return errors
    if not r.enable_chunked_prefill and tokens < context:
        errors.append(f"{key}={tokens} with enable_chunked_prefill=false cannot hold one sequence of the "
                      f"engine's context length ({ARR}.rollout.max_model_len, or data.max_prompt_length + "
                      f"max_response_length) = {context} tokens: raise it to >= {context} or set "
                      f"{ARR}.rollout.enable_chunked_prefill=true")
    if tokens < r.max_num_seqs:
        errors.append(f"{key}={tokens} must be >= {ARR}.rollout.max_num_seqs={r.max_num_seqs} (one token "
                      "per running sequence per step): raise it or lower max_num_seqs")
    return errors


def overlong_buffer_errors(cfg) -> list[str]:
    """DAPO's length penalty: the dapo manager's, within the response length."""
    rm, errors = cfg.reward_model, []
    buffer, longest = rm.overlong_buffer, cfg.data.max_response_length
    if not buffer.enable:
        return errors
    if rm.reward_manager != "dapo":
        errors.append(f"reward_model.overlong_buffer.enable=true is applied by the dapo reward manager: set "
                      f"reward_model.reward_manager=dapo (it is {rm.reward_manager})")
    if not 0 < buffer.len <= longest:
        errors.append(f"reward_model.overlong_buffer.len={buffer.len} must be in [1, data.max_response_length="
                      f"{longest}]: the penalty starts that many tokens before the maximum length")
    if buffer.penalty_factor < 0:
        errors.append(f"reward_model.overlong_buffer.penalty_factor={buffer.penalty_factor} must be >= 0")
    return errors


def checkpoint_errors(cfg) -> list[str]:
    """verl's ``checkpoint.save_contents`` / ``load_contents``: a checkpoint here always holds
    what an exact resume needs, so those may add ``hf_model`` but not leave a part out."""
    errors, required = [], CHECKPOINT_CONTENTS[:3]
    for section, node in ((f"{ARR}.actor.checkpoint", cfg.actor_rollout_ref.actor.checkpoint),
                          ("critic.checkpoint", cfg.critic.checkpoint)):
        for name in ("save_contents", "load_contents"):
            contents = getattr(node, name)
            if contents is None:
                continue
            unknown = [c for c in contents if c not in CHECKPOINT_CONTENTS]
            missing = [c for c in required if c not in contents]
            if unknown:
                errors.append(f"{section}.{name} names {unknown}: use some of {list(CHECKPOINT_CONTENTS)}")
            elif missing:
                errors.append(f"{section}.{name}={contents} leaves out {missing}: a checkpoint always holds "
                              f"{list(required)} (a resumed run equals an uninterrupted one); add them "
                              "(hf_model is the optional extra)")
    return errors


RC = "algorithm.rollout_correction"


def rollout_correction_on(rc) -> bool:
    """Weights or rejection asked for: the trainer then needs the old log-probs' forward."""
    return rc.rollout_is is not None or bool(rc.rollout_rs)


def rollout_correction_errors(cfg) -> list[str]:
    """Rejection options and thresholds that hybridflow/algorithms/rollout_correction.py would refuse,
    and a correction without the trainer's old log-probs to correct against."""
    from hybridflow.algorithms.rollout_correction import ROLLOUT_RS_OPTIONS, parse_rs, parse_rs_thresholds

    rc, errors = cfg.algorithm.rollout_correction, []
    options = parse_rs(rc.rollout_rs)
    unknown = [o for o in options if o not in ROLLOUT_RS_OPTIONS]
    errors += [unknown_name(f"{RC}.rollout_rs", o, ROLLOUT_RS_OPTIONS) for o in unknown]
    if options and not unknown:
        if rc.rollout_rs_threshold is None:
            errors.append(f"{RC}.rollout_rs={rc.rollout_rs} needs {RC}.rollout_rs_threshold (e.g. 2.0 for k1: "
                          "keep ratios in [0.5, 2]; an upper bound for k2/k3)")
        else:
            try:
                parse_rs_thresholds(options, rc.rollout_rs_threshold)
            except ValueError as e:
                errors.append(f"{RC}.rollout_rs_threshold={rc.rollout_rs_threshold!r}: {e}")
    if not options and rc.rollout_rs_threshold is not None:
        errors.append(f"{RC}.rollout_rs_threshold={rc.rollout_rs_threshold!r} is used only by rollout rejection: "
                      f"set {RC}.rollout_rs, or leave the threshold null")
    if rollout_correction_on(rc) and cfg.actor_rollout_ref.actor.recompute_old_log_prob == "skip":
        errors.append(f"{RC} weighs pi_old/pi_rollout, but {ARR}.actor.recompute_old_log_prob=skip computes no "
                      "old log-probs: use auto or always")
    return errors


def rollout_pool_errors(cfg) -> list[str]:
    """``actor_rollout_ref.hybrid_engine=false``: what the rollout's own pool can run
    (hybridflow/trainer/async_rollout.py)."""
    arr, at = cfg.actor_rollout_ref, cfg.async_training
    if arr.hybrid_engine:
        return []
    errors = []
    world, rtp = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node, arr.rollout.tensor_model_parallel_size
    if arr.rollout.name != "vllm":
        errors.append(f"{ARR}.hybrid_engine=false runs the rollout on a pool of its own, which only "
                      f"{ARR}.rollout.name=vllm can (hf generates with the actor's module): set rollout.name=vllm")
    if world % rtp:
        errors.append(f"{ARR}.rollout.tensor_model_parallel_size={rtp} must divide the rollout pool's "
                      f"rollout.nnodes*rollout.n_gpus_per_node={world} workers: use one of "
                      f"{[d for d in range(1, world + 1) if world % d == 0]}")
    return errors


def bypass_errors(cfg) -> list[str]:
    """pi_old taken from the rollout (verl's bypass mode, or use_rollout_log_probs) with what needs
    the trainer's own pi_old."""
    rc, arr, errors = cfg.algorithm.rollout_correction, cfg.actor_rollout_ref, []
    keys = ([f"{RC}.bypass_mode"] if rc.bypass_mode else []) + (
        ["async_training.use_rollout_log_probs"] if cfg.async_training.use_rollout_log_probs
        and not arr.hybrid_engine else [])
    if not keys:
        return []
    said = " and ".join(f"{k}=true" for k in keys)
    if rollout_correction_on(rc):
        errors.append(f"{said} makes pi_old the rollout's own log-probs, so {RC}'s weights pi_old/pi_rollout are "
                      f"all 1 (verl weighs pi_theta/pi_rollout inside the loss there, not implemented here): set "
                      f"{RC}.rollout_is and rollout_rs to null, or {keys[0]}=false")
    if arr.actor.recompute_old_log_prob == "skip":
        errors.append(f"{said} takes pi_old from the rollout, but {ARR}.actor.recompute_old_log_prob=skip uses the "
                      "update's own forward: use auto or always")
    return errors


def stage_fusion_errors(cfg, roles) -> list[str]:
    """``stage_fusion``: what streaming generation and the fused update can run on
    (hybridflow/config/stage_fusion.py); ``roles``: the run's models (model_checks.ModelRoles)."""
    sf, arr, errors = cfg.stage_fusion, cfg.actor_rollout_ref, []
    if sf.enable and arr.rollout.name != "vllm":
        errors.append(f"stage_fusion.enable=true streams finished samples out of vLLM's engine steps: set "
                      f"{ARR}.rollout.name=vllm, or stage_fusion.enable=false")
    if sf.enable and not arr.hybrid_engine:
        errors.append(f"stage_fusion.enable=true streams the batch a step trains on, and {ARR}.hybrid_engine=false "
                      "generates whole batches ahead on the rollout's own pool: use one of the two")
    if sf.fuse_actor_critic_update:
        critic = cfg.critic
        where = (f"{ARR}.actor.strategy={arr.actor.strategy}, critic.strategy={critic.strategy}")
        if not roles.critic:
            errors.append("stage_fusion.fuse_actor_critic_update=true fuses the critic's update with the actor's, "
                          f"and this run has no critic (algorithm.adv_estimator={cfg.algorithm.adv_estimator}): "
                          "set it to false")
        elif arr.actor.strategy != "megatron" or critic.strategy != "megatron":
            errors.append(f"stage_fusion.fuse_actor_critic_update=true fuses Megatron pipeline schedules ({where}): "
                          "set both strategies to megatron, or the key to false")
        else:
            (actor_tp, actor_pp), (critic_tp, critic_pp) = roles.actor_parallel, roles.critic_parallel
            if actor_pp < 2 or (actor_tp, actor_pp) != (critic_tp, critic_pp):
                errors.append("stage_fusion.fuse_actor_critic_update=true needs the actor and the critic on the "
                              f"same pipeline of 2 or more stages (actor tp={actor_tp} pp={actor_pp}, critic "
                              f"tp={critic_tp} pp={critic_pp}): set {ARR}.actor.megatron and critic.megatron's "
                              "pipeline_model_parallel_size to the same value >= 2")
        if cfg.trainer.placement != "colocate":
            errors.append("stage_fusion.fuse_actor_critic_update=true runs both updates in one process per slot: "
                          f"set trainer.placement=colocate (it is {cfg.trainer.placement})")
    return errors


def reallocation_errors(cfg) -> list[str]:
    """``actor_rollout_ref.rollout.reallocation``: what sample reallocation can run on
    (hybridflow/config/reallocation.py)."""
    arr = cfg.actor_rollout_ref
    key, errors = f"{ARR}.rollout.reallocation.enable=true", []
    if not arr.rollout.reallocation.enable:
        return errors
    if arr.rollout.name != "vllm":
        errors.append(f"{key} moves unfinished samples between vLLM engines: set {ARR}.rollout.name=vllm, or "
                      "the key to false")
    if not arr.hybrid_engine:
        errors.append(f"{key} rebalances the actor's own generation ranks, and {ARR}.hybrid_engine=false generates "
                      "whole batches ahead on the rollout's own pool: use one of the two")
    if cfg.stage_fusion.enable:
        errors.append(f"{key} and stage_fusion.enable=true: the fused rollout moves its tail by "
                      "stage_fusion.migrate_below and does not reallocate: set one of the two to false")
    policy = arr.rollout.engine_kwargs.vllm.get("scheduling_policy", "priority")
    if arr.rollout.reallocation.adopted_first and policy != "priority":
        errors.append(f"{ARR}.rollout.reallocation.adopted_first=true starts moved samples first by vLLM's priority "
                      f"policy, and {ARR}.rollout.engine_kwargs.vllm.scheduling_policy={policy}: drop that key, "
                      "or set adopted_first=false")
    return errors
