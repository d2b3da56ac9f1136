"""Inference on one rank alone, with no collective across ranks (issue 34, stream fusion).

While some ranks still generate the long tail, a freed rank computes old log-probs, reference
log-probs or values on a chunk of finished rows by itself; any collective there would wait for
ranks that are busy in vLLM. That is only possible where a forward needs no other rank:

- FSDP replicated (``fsdp_size=1``): every rank holds the whole model. ``FSDPEngine._infer(local=
  True)`` skips its cross-rank micro-batch count check, and the token-budget planner counts alone.
- Megatron with TP = PP = 1 (pure data parallel): the only cross-rank step of an inference call
  is token_budget's all-reduce of the micro-batch count (workers/engines/token_budget.py), which
  ``token_budget.local_plans()`` turns off; the TP group of one rank reduces nothing.

Anything else (sharded FSDP, TP or PP > 1) is refused with the reason, before any forward.
"""
from __future__ import annotations

from torch import Tensor

from workers.engines.token_budget import local_plans


def local_inference_block(engine) -> str | None:
    """Why ``engine`` cannot run inference on this rank alone; None when it can."""
    own = getattr(engine, "local_inference_block", None)
    if own is not None:  # FSDP knows its own layout
        return own()
    tp, pp = getattr(engine, "tp", None), getattr(engine, "pp", None)
    if tp is None or pp is None:
        return f"{type(engine).__name__} does not say whether its forward needs other ranks"
    if tp > 1 or pp > 1:
        return (f"Megatron TP={tp}, PP={pp}: every forward exchanges activations with the other "
                "tensor/pipeline ranks; local inference needs tp=pp=1")
    return None


def _check(engine, what: str) -> None:
    why = local_inference_block(engine)
    if why:
        raise ValueError(f"{what}: no local inference on this layout: {why}")


def local_log_prob(engine, data, temperature: float, calculate_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """``engine.compute_log_prob`` on this rank's rows alone (see the module docstring)."""
    _check(engine, "compute_log_prob")
    if hasattr(engine, "local_inference_block"):
        return engine.compute_log_prob(data, temperature, calculate_entropy, local=True)
    with local_plans():
        return engine.compute_log_prob(data, temperature, calculate_entropy)


def local_values(engine, data) -> Tensor:
    """``engine.compute_values`` on this rank's rows alone."""
    _check(engine, "compute_values")
    if hasattr(engine, "local_inference_block"):
        return engine.compute_values(data, local=True)
    with local_plans():
        return engine.compute_values(data)
