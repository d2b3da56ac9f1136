"""Rules of verl keys whose checks do not fit the general ones: vLLM's scheduler limits, and the
keys accepted so verl scripts run, for their "off" value only. Each message names the key and
the fix, as everywhere in ``validate``."""
from __future__ import annotations

from hybridflow.config.root import RootConfig

ARR = "actor_rollout_ref"


def rollout_errors(cfg: RootConfig) -> list[str]:
    """vLLM's scheduler rules, checked here so they fail before any worker starts."""
    r, errors = cfg.actor_rollout_ref.rollout, []
    tokens, key = r.max_num_batched_tokens, f"{ARR}.rollout.max_num_batched_tokens"
    if r.name != "vllm" or tokens is None:
        return errors
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if not r.enable_chunked_prefill and tokens < longest:
        errors.append(f"{key}={tokens} with enable_chunked_prefill=false cannot hold one sequence of "
                      f"data.max_prompt_length + max_response_length = {longest} tokens: raise it to "
                      f">= {longest} or set {ARR}.rollout.enable_chunked_prefill=true")
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
    if cfg.trainer.default_hdfs_dir:
        errors.append(f"trainer.default_hdfs_dir={cfg.trainer.default_hdfs_dir!r}: HDFS upload is not "
                      "implemented; set it to null and copy trainer.default_local_dir yourself")
    return errors
