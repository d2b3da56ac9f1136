"""LoRA adapters on an HF model's linear layers (Hu et al. 2021, "LoRA", eq. 3), for the FSDP engine.

    h = W0 x + (alpha / r) * B A x,   W0 frozen,   A: [r, in] (Kaiming-uniform),   B: [out, r] (zeros)

so a fresh adapter leaves the model unchanged. Only A and B train: the optimizer keeps state for
them alone and backward skips every frozen weight's gradient matmul.

What differs from peft: the adapter is not a wrapper module. ``lora_A`` / ``lora_B`` are extra
parameters of the target ``nn.Linear`` itself and a forward hook adds their term, so every HF
name (``...q_proj.weight``) stays as it is and FSDP2, DDP, checkpoints and gradient checkpointing
see an ordinary module. Weights leave the engine merged (``W0 + alpha/r B A`` under the HF name,
:func:`merge_lora`): vLLM and the HF export get a plain model, and generation costs what the base
model's does.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor, nn

from hybridflow.lora_targets import ALL_LINEAR, target_linear_names

LORA_PARAMS = ("lora_A", "lora_B")


def _add_lora_term(module: nn.Linear, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
    if not module.lora_enabled:
        return output
    x = inputs[0].to(module.lora_A.dtype)
    return output + (x @ module.lora_A.t() @ module.lora_B.t()).to(output.dtype) * module.lora_scaling


def add_lora(model: nn.Module, rank: int, alpha: float, target_modules: str | Sequence[str] = ALL_LINEAR,
             exclude_modules: Sequence[str] | None = None) -> list[str]:
    """Freeze ``model`` and give its target linear layers trainable ``lora_A`` / ``lora_B``
    (in place). Draws A from torch's global RNG: seed it the same on every rank. Returns the
    adapted module paths."""
    if rank < 1:
        raise ValueError(f"lora rank={rank} must be a positive integer")
    names = target_linear_names(model, target_modules, exclude_modules)
    for p in model.parameters():
        p.requires_grad_(False)
    modules = dict(model.named_modules())
    for name in names:
        linear = modules[name]
        w = linear.weight
        a = nn.Parameter(torch.empty(rank, linear.in_features, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # peft's (and nn.Linear's) init for A
        linear.register_parameter("lora_A", a)
        linear.register_parameter("lora_B", nn.Parameter(torch.zeros(linear.out_features, rank, dtype=w.dtype,
                                                                     device=w.device)))
        linear.lora_scaling, linear.lora_enabled = alpha / rank, True
        linear.register_forward_hook(_add_lora_term)
    return names


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Run ``model`` as its frozen base for the body: the reference policy of a LoRA run without a
    second copy of the weights (as verl does)."""
    adapted = [m for m in model.modules() if hasattr(m, "lora_scaling")]
    for m in adapted:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in adapted:
            m.lora_enabled = True


def lora_scalings(model: nn.Module) -> dict[str, float]:
    """``{module path: alpha / r}`` of every adapted layer (empty without LoRA)."""
    return {name: m.lora_scaling for name, m in model.named_modules() if hasattr(m, "lora_scaling")}


def merge_lora(named_tensors: Iterable[tuple[str, Tensor]], scalings: dict[str, float]) -> Iterator[tuple[str, Tensor]]:
    """Full tensors in HF order -> the same with every adapted ``<m>.weight`` replaced by
    ``W0 + scaling * B @ A`` and the ``lora_*`` entries left out. A weight waits (copied: a stream
    may reuse its buffers) until its A and B have passed; they follow it in registration order."""
    pending: dict[str, dict[str, Tensor]] = {}
    for name, tensor in named_tensors:
        module, _, leaf = name.rpartition(".")
        if module not in scalings or leaf not in ("weight", *LORA_PARAMS):
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[leaf] = tensor.detach().clone()
        if len(parts) == 3:
            del pending[module]
            delta = (parts["lora_B"].float() @ parts["lora_A"].float()) * scalings[module]
            yield f"{module}.weight", (parts["weight"].float() + delta).to(parts["weight"].dtype)
    if pending:
        raise RuntimeError(f"merge_lora: weights or adapters of {sorted(pending)} never completed; pass every "
                           "parameter of the model")
