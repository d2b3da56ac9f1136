"""The KV cache a CPU vLLM engine gets when ``rollout.kv_cache_gib`` is null (the default).

On CPU vLLM allocates its whole KV cache when the engine starts, zero-filled, and keeps it for
the worker's life (it cannot sleep there, so ``free_cache_engine`` frees nothing). A fixed 1 GiB
per engine cost every colocated worker 1 GiB of resident memory and 0.6 s of page faults at
start-up, where the demo's model needs 32-64 MiB for the most it can ever run at once
(scripts/bench/launch.py: a worker's peak RSS 1.87 GB against 0.83 GB). The default is that most: ``max_num_seqs`` sequences of the whole
context plus the speculative look-ahead, each rounded up to whole KV blocks, in the engine's dtype,
the draft model's layers included, at most ``CAP_GIB`` (the former fixed size). So a small model
gets what it can use, and a workload that needs more keeps what it had: vLLM queues the
sequences that do not fit, as before. On GPU ``gpu_memory_utilization`` sizes the cache instead.

The per-token size is the textbook ``2 (K and V) x layers x KV heads x head_dim x bytes``. Where a
model caches less than that (sliding windows, MLA's compressed latent, an fp8 cache from
``engine_kwargs``) the estimate is high, which costs only RAM under the cap; a config this cannot
read gets the cap. The planner counts the same bytes (``hybridflow.placement.workload.ModelShape``);
workers do not import the planner (DESIGN.md's import direction), so this reads the config itself.
"""
from __future__ import annotations

GiB = 2**30
CAP_GIB = 1.0
# a sequence's share is rounded up to this many tokens: vLLM's CPU attention takes blocks of 128
# tokens by default and some of its backends 256, so 256 never undercounts a sequence
BLOCK_TOKENS = 256
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(hf_config, dtype_bytes: int) -> int | None:
    """Bytes of K and V one token takes over all layers, or None when the config lacks a size."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None)
    if not head_dim and heads and getattr(text, "hidden_size", None):
        head_dim = text.hidden_size // heads
    if not (layers and kv_heads and head_dim):
        return None
    return 2 * int(layers) * int(kv_heads) * int(head_dim) * dtype_bytes


def auto_kv_cache_bytes(hf_config, dtype: str, max_num_seqs: int, context_length: int,
                        lookahead: int = 0, draft_hf_config=None) -> int:
    """What ``max_num_seqs`` sequences of ``context_length + lookahead`` tokens need in the engine's
    ``dtype`` (``auto``: counted as float32), at most ``CAP_GIB``."""
    dtype_bytes = DTYPE_BYTES.get(dtype, 4)
    per_token = kv_bytes_per_token(hf_config, dtype_bytes)
    if per_token is not None and draft_hf_config is not None:
        draft = kv_bytes_per_token(draft_hf_config, dtype_bytes)
        per_token = None if draft is None else per_token + draft
    cap = int(CAP_GIB * GiB)
    if per_token is None:
        return cap
    tokens = -(-(context_length + lookahead) // BLOCK_TOKENS) * BLOCK_TOKENS
    return min(cap, max_num_seqs * tokens * per_token)
