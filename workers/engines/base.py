"""The training-engine protocol (docs/contracts.md "Training engine") and batch helpers both
engines share: micro-batch splitting, padding trimming and the loss-scaling convention.

Loss scaling, once for both engines. ``train_batch`` receives this rank's share of one
mini-batch, splits it into micro-batches, and back-propagates ``loss_fn(...) * micro_rows /
mini_rows`` for each; the data-parallel gradient reduction then *averages* over the ``dp_size``
ranks. So a loss_fn that returns a per-micro-batch mean trains on the row-weighted mean of those
means (verl's classic behaviour). A loss_fn that wants the exact token mean over the whole
mini-batch on all ranks uses :func:`mini_batch_token_mean`, which undoes both factors with the
numbers the engine puts into every micro-batch's ``meta_info`` (keys below).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import torch
from torch import Tensor

from workers.engines.config import EngineConfig

# Added by train_batch to every micro-batch's meta_info before loss_fn sees it.
META_DP_SIZE = "dp_size"                          # data-parallel ranks the gradient is averaged over
META_MINI_BATCH_ROWS = "mini_batch_rows"          # rows of the mini-batch on this rank
META_GLOBAL_TOKENS = "mini_batch_response_tokens"  # response_mask.sum() of the mini-batch, all ranks

LossFn = Callable[[dict[str, Tensor], Any], tuple[Tensor, dict[str, float]]]
"""``loss_fn(outputs, micro_batch) -> (scalar loss, metrics)``.

outputs: ``{"log_probs": [m, R]}`` plus ``"entropy": [m, R]`` when the batch's
``meta_info["calculate_entropy"]`` is true (actor), or ``{"values": [m, R]}`` (critic).
"""


@runtime_checkable
class TrainEngine(Protocol):
    dp_rank: int
    dp_size: int
    is_collect: bool

    def __init__(self, config: EngineConfig, model_path: str, role: str) -> None: ...

    def compute_log_prob(self, data, temperature: float,
                         calculate_entropy: bool = False) -> tuple[Tensor, Tensor | None]: ...

    def compute_values(self, data) -> Tensor: ...

    def train_batch(self, data, loss_fn: LossFn) -> dict[str, float]: ...

    def export_hf_weights(self) -> Iterator[tuple[str, Tensor]]: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def save_hf(self, path: str) -> None: ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...


def split_micro_batches(data, micro_batch_size: int) -> list:
    """Contiguous micro-batches of ``micro_batch_size`` rows (the last may be shorter).

    Each part carries its own copy of ``meta_info`` so per-micro additions never leak back.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size}: use a positive integer")
    parts = data.split(micro_batch_size)
    for part in parts:
        part.meta_info = dict(part.meta_info)
    return parts


def active_span(attention_mask: Tensor, prompt_length: int) -> tuple[int, int]:
    """Columns ``[start, end)`` outside which every row is padding.

    Prompts are left-padded and responses right-padded, so columns before the earliest first real
    token and after the latest last real token carry no information for any row: dropping them
    changes no real token's output (masked keys get exactly zero attention weight) and saves the
    compute on padding. ``start`` never passes ``prompt_length - 1`` so the logit that predicts
    the first response token stays inside the span; ``end`` keeps at least one response column.
    """
    real = attention_mask.bool()
    cols = torch.nonzero(real.any(dim=0)).flatten()
    if cols.numel() == 0:
        return prompt_length - 1, prompt_length + 1
    start = min(int(cols[0]), prompt_length - 1)
    end = max(int(cols[-1]) + 1, prompt_length + 1)
    return start, min(end, attention_mask.shape[1])


def mini_batch_token_mean(token_values: Tensor, mask: Tensor, micro_batch) -> Tensor:
    """Micro-batch loss whose accumulated, DP-averaged gradient is that of the token mean of
    ``token_values`` over the *whole* mini-batch on all ranks.

    With ``N`` = response tokens of the mini-batch over all ranks, the target is
    ``sum_all(v * mask) / N``. The engine scales each micro loss by ``m / M`` (micro rows over this
    rank's mini rows) and the gradient reduction divides by ``dp``; multiplying by ``dp * M / m``
    here cancels both, leaving ``sum_micro(v * mask) / N`` per micro-batch, which sums to the target.
    """
    meta = micro_batch.meta_info
    for key in (META_DP_SIZE, META_MINI_BATCH_ROWS, META_GLOBAL_TOKENS):
        if key not in meta:
            raise ValueError(f"mini_batch_token_mean: micro-batch meta_info lacks {key!r}; call it from a "
                             "loss_fn run by TrainEngine.train_batch")
    scale = meta[META_DP_SIZE] * meta[META_MINI_BATCH_ROWS] / len(micro_batch)
    total = max(float(meta[META_GLOBAL_TOKENS]), 1.0)
    return (token_values * mask).sum() * (scale / total)
