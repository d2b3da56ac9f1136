"""How new weights get into a running vLLM engine: live weights on CPU, vLLM's reload elsewhere.

vLLM's CPU backend repacks every linear weight into a oneDNN (or sgl-kernel) layout after
loading and then frees the plain weight. Its in-place ``reload_weights`` must therefore rebuild
every layer from meta tensors, copy the new weights in and repack, on every sync. At the demo
size the meta round trip alone was two thirds of the 25 ms a sync took: the floor the
3D-HybridEngine's transfer could not go under.

**Live weights** (CPU, unquantized models): the engine keeps each GEMM layer's plain ``weight``
Parameter (vLLM's ``_cpu_skip_gemm_dispatch`` switch while the engine is built) and builds the
packed kernel handle from it (vLLM's own ``dispatch_cpu_unquantized_gemm``, so generation runs
the same oneDNN/sgl kernels as stock vLLM). A sync is ``model.load_weights``, vLLM's own
per-architecture loaders (fused qkv and gate/up, TP slicing, name mapping) copying straight into
those Parameters, then one repack per GEMM layer. The cost: the plain weights stay resident next
to the packed copies (one generation shard, the size vLLM's own load peaks at). Plain ``F.linear``
on the live weights would avoid the repack too, but measured 1.2-2x slower per decode GEMM than
the packed kernels (docs/benchmarks.md).

Everything else (GPU, quantized or MoE layers, whose post-load processing transforms weights)
keeps vLLM's ``reload_weights`` plus :func:`retie_lm_head`.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterable

import torch

# vLLM loggers that print an INFO line on every weight sync ("Reloading and processing weights
# took ...", "Successfully reset prefix cache"); their warnings still show.
PER_SYNC_INFO_LOGGERS = ("vllm.model_executor.model_loader.reload.inplace", "vllm.v1.core.block_pool")
log = logging.getLogger(__name__)


def quiet_per_sync_logs() -> None:
    """An INFO line from each of these per weight sync would bury the trainer's progress table."""
    for name in PER_SYNC_INFO_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


class ExpectedReloadWarnings(logging.Filter):
    """Drops the two warnings vLLM's in-place reload logs on every weight sync for layers that
    have nothing to load: RotaryEmbedding (no weights) and, for tied models, the LM head (it
    shares the embedding; :func:`retie_lm_head` refreshes it). Any other layer's warning, i.e. a
    weight the sync really missed, still shows."""

    def __init__(self, tied: bool):
        super().__init__()
        self.expected = {"RotaryEmbedding", "ParallelLMHead"} if tied else {"RotaryEmbedding"}

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and record.args[0] in self.expected)


@contextlib.contextmanager
def linears_keep_weights():
    """While an engine is built in this process, its CPU linears keep plain weights (no repack)."""
    from vllm.model_executor.layers.linear import LinearBase

    saved = LinearBase.__dict__.get("_cpu_skip_gemm_dispatch")
    LinearBase._cpu_skip_gemm_dispatch = True
    try:
        yield
    finally:
        if saved is None:
            del LinearBase._cpu_skip_gemm_dispatch
        else:
            LinearBase._cpu_skip_gemm_dispatch = saved


def _gemm_layers(model) -> list:
    """Layers whose CPU GEMM goes through a kernel handle vLLM built (they have ``cpu_linear``)."""
    return [m for m in model.modules() if hasattr(m, "cpu_linear")]


def _repack(layers) -> None:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for layer in layers:
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)


def use_live_weights(worker) -> str | None:
    """Runs inside vLLM's worker (via collective_rpc): pack every GEMM from its live weight.

    Returns None when done, else why live weights cannot serve this model (e.g. MoE experts, which
    vLLM post-processes); the linears are then packed as a stock build packs them, and the caller
    keeps vLLM's reload.
    """
    model = worker.model_runner.get_model()
    why = _why_not_live(model)
    if why:
        _stock_linears(model)
        return why
    _repack(_gemm_layers(model))
    return None


def _why_not_live(model) -> str | None:
    """The first layer live weights cannot serve, and why; None when they serve every layer."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase) and not isinstance(
                method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
            return f"{name} uses {type(method).__name__}, whose weights vLLM post-processes"
        if hasattr(module, "cpu_linear"):
            weight = getattr(module, "weight", None)
            if weight is None or weight.is_meta or weight.numel() == 0 or weight.ndim != 2:
                return f"{name} ({type(module).__name__}) kept no plain 2-D weight"
    return None


def _stock_linears(model) -> None:
    """Process the linears the way a stock build does (packed, plain weight dropped), for an engine
    that keeps vLLM's reload: the reload's restore step expects the stock layout of every layer."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    for module in model.modules():
        if (isinstance(module, LinearBase) and isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod)
                and not getattr(module, "_cpu_skip_gemm_dispatch", False)):  # MLA's kv_b_proj stays plain
            module.quant_method.process_weights_after_loading(module)


def load_live_weights(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Runs inside vLLM's worker: copy HF-named tensors into the live Parameters, then repack.

    Returns the names of Parameters nothing was loaded into (a tied LM head, which shares the
    embedding's Parameter, is not one of them).

    Each tensor is first rounded to the engine's dtype, as a load from a checkpoint rounds it: on
    AMX CPUs vLLM's small-GEMM kernel keeps its bias in fp32, so a trainer's fp32 bias copied in
    as is stayed unrounded, and a bf16 engine's log-probs differed by up to 0.016 from the same
    weights loaded fresh (a val_only run of the export then did not reproduce the last validation).
    """
    model = worker.model_runner.get_model()
    dtype = worker.model_runner.model_config.dtype
    weights = ((name, t.to(dtype) if t.is_floating_point() else t) for name, t in weights)
    with torch.no_grad():
        loaded = model.load_weights(weights)
    _repack(_gemm_layers(model))
    if loaded is None:  # a model whose loader does not report what it loaded
        return []
    shared = {id(p) for n, p in model.named_parameters() if n in loaded}
    return [n for n, p in model.named_parameters(remove_duplicate=False)
            if n not in loaded and id(p) not in shared]


def retie_lm_head(worker) -> int:
    """Runs inside vLLM's worker (via collective_rpc): make a tied LM head use the new embedding.

    Needed after ``reload_weights`` only. vLLM ties by sharing the embedding's Parameter with the
    LM head, and on CPU the LM head's GEMM runs on a packed copy of that weight made at load
    time. An in-place reload skips ``lm_head.weight`` (tied checkpoints have none), so the head
    keeps the old packed copy and log-probs stay those of the old weights. Re-sharing the
    Parameter and re-running the head's ``process_weights_after_loading`` rebuilds the packed
    copy from the new embedding. Returns the number of heads re-tied.
    """
    model = worker.model_runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or not hasattr(lm_head, "quant_method"):
        return 0
    lm_head.weight = embed.weight
    lm_head.quant_method.process_weights_after_loading(lm_head)
    return 1
