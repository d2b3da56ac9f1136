"""Rules of verl keys whose checks do not fit the general ones: vLLM's scheduler limits, and the
keys accepted so verl scripts run, for their "off" value only. Each message names the key and
the fix, as everywhere in ``validate``."""
from __future__ import annotations

import logging

from hybridflow.config.root import RootConfig

logger = logging.getLogger(__name__)

ARR = "actor_rollout_ref"


# verl's load formats: its dummy_* family (random init; the weight sync fills the engine before its
# first generation) is vLLM's "dummy"; the others are vLLM's names for reading a local checkpoint
ROLLOUT_LOAD_FORMATS = ("auto", "hf", "safetensors", "pt", "npcache",
                        "dummy", "dummy_dtensor", "dummy_hf", "dummy_megatron")
# vLLM LLM(...) arguments hybridflow sets itself: the hybridflow key that sets each
VLLM_KWARGS_FROM_KEYS = {
    "model": f"{ARR}.model.path",
    "tensor_parallel_size": f"{ARR}.rollout.tensor_model_parallel_size",
    "dtype": f"{ARR}.rollout.dtype",
    "seed": "trainer.seed",
    "enforce_eager": f"{ARR}.rollout.enforce_eager",
    "max_model_len": f"{ARR}.rollout.max_model_len",
    "max_num_seqs": f"{ARR}.rollout.max_num_seqs",
    "max_num_batched_tokens": f"{ARR}.rollout.max_num_batched_tokens",
    "enable_chunked_prefill": f"{ARR}.rollout.enable_chunked_prefill",
    "enable_prefix_caching": f"{ARR}.rollout.enable_prefix_caching",
    "disable_log_stats": f"{ARR}.rollout.disable_log_stats",
    "load_format": f"{ARR}.rollout.load_format",
    "gpu_memory_utilization": f"{ARR}.rollout.gpu_memory_utilization",
    "kv_cache_memory_bytes": f"{ARR}.rollout.kv_cache_gib",
    "enable_sleep_mode": f"{ARR}.rollout.free_cache_engine",
    "hf_overrides": f"{ARR}.model.override_config",  # the training engines apply it too
}
# ... and those no key changes, because the rollout relies on them
VLLM_KWARGS_FIXED = {
    "distributed_executor_backend": "vLLM runs inside the worker group's torch.distributed world",
    "skip_tokenizer_init": "prompts go in as token ids",
    "logprobs_mode": "rollout log-probs are those of the distribution each token was sampled from",
}


def rollout_errors(cfg: RootConfig) -> list[str]:
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


def overlong_buffer_errors(cfg: RootConfig) -> list[str]:
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


def unsupported_errors(cfg: RootConfig) -> list[str]:
    """verl keys accepted so its scripts run, for the value that means "off" only."""
    errors = []
    sp = cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size
    if sp != 1:
        errors.append(f"{ARR}.actor.ulysses_sequence_parallel_size={sp}: Ulysses sequence parallelism is not "
                      "implemented; set it to 1 (long sequences: use_remove_padding, use_dynamic_bsz, or "
                      "strategy=megatron with tensor parallelism)")
    if cfg.actor_rollout_ref.rollout.mode != "sync":
        errors.append(f"{ARR}.rollout.mode={cfg.actor_rollout_ref.rollout.mode!r}: only sync is implemented "
                      "(whole batches through the engine); set it to sync")
    if not cfg.actor_rollout_ref.hybrid_engine:
        errors.append(f"{ARR}.hybrid_engine=false: the actor and its rollout always share each worker here "
                      "(trainer.placement=separate moves the reference, critic and reward model); set it to true")
    model = cfg.actor_rollout_ref.model
    errors += lora_strategy_errors(f"{ARR}.model", model.lora_rank, f"{ARR}.actor.strategy",
                                   cfg.actor_rollout_ref.actor.strategy)
    errors += lora_strategy_errors("critic.model", cfg.critic.model.lora_rank, "critic.strategy", cfg.critic.strategy)
    for key in ("use_liger", "use_fused_kernels"):
        if getattr(model, key):
            errors.append(f"{ARR}.model.{key}=true: these kernels are not used here (the models run "
                          f"transformers' and megatron-core's own layers); set it to false")
    if model.trust_remote_code:
        errors.append(f"{ARR}.model.trust_remote_code=true: remote model code is never run (the engines "
                      "support Llama/Qwen2-family models, which transformers ships); set it to false")
    if cfg.trainer.default_hdfs_dir:
        errors.append(f"trainer.default_hdfs_dir={cfg.trainer.default_hdfs_dir!r}: HDFS upload is not "
                      "implemented; set it to null and copy trainer.default_local_dir yourself")
    return errors


def lora_strategy_errors(section: str, rank: int, strategy_key: str, strategy: str) -> list[str]:
    if rank and strategy != "fsdp":
        return [f"{section}.lora_rank={rank}: LoRA adapters are implemented for {strategy_key}=fsdp; set it, "
                f"or lora_rank=0 with {strategy}"]
    return []


def convert_global_micro_batch_sizes(cfg: RootConfig) -> list[str]:
    """verl's deprecated micro-batch sizes count sequences over all of a role's data-parallel
    ranks; verl's workers divide them by that size and use the result as the ``*_per_gpu`` key.
    Done here, in place, so the rest of the config reads one key. A converted key is cleared, so
    validating again changes nothing. Assumes the parallel sizes were checked."""
    from hybridflow.config.derived import derive, reward_pool_world

    d, arr, errors = derive(cfg), cfg.actor_rollout_ref, []
    reward_dp = reward_pool_world(cfg) or (d.aux_world if cfg.trainer.placement == "separate" else d.actor_world)
    rows = [(arr.actor, f"{ARR}.actor", "ppo_micro_batch_size", d.actor_dp),
            (arr.rollout, f"{ARR}.rollout", "log_prob_micro_batch_size", d.actor_dp),
            (arr.ref, f"{ARR}.ref", "log_prob_micro_batch_size", d.actor_dp),
            (cfg.critic, "critic", "ppo_micro_batch_size", d.critic_dp),
            (cfg.critic, "critic", "forward_micro_batch_size", d.critic_dp),
            (cfg.reward_model, "reward_model", "micro_batch_size", reward_dp)]
    for node, section, name, dp in rows:
        total = getattr(node, name)
        if total is None:
            continue
        key = f"{section}.{name}"
        if dp and (total < dp or total % dp):
            errors.append(f"{key}={total} (verl's deprecated size over all {dp} data-parallel ranks) must be a "
                          f"positive multiple of {dp}: set {key}_per_gpu instead (sequences per rank) and "
                          f"remove {key}")
            continue
        if dp:
            setattr(node, f"{name}_per_gpu", total // dp)
            logger.warning("%s=%d is deprecated (verl): using %s_per_gpu=%d (%d data-parallel ranks)",
                           key, total, key, total // dp, dp)
        setattr(node, name, None)
    return errors


def checkpoint_errors(cfg: RootConfig) -> list[str]:
    """verl's ``checkpoint.save_contents`` / ``load_contents``: a checkpoint here always holds
    what an exact resume needs, so those may add ``hf_model`` but not leave a part out."""
    from hybridflow.config.common import CHECKPOINT_CONTENTS

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
