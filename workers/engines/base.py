"""The training-engine protocol (docs/contracts.md "Training engine") and batch helpers both
engines share: micro-batch splitting, padding trimming and the loss-scaling convention.

Loss scaling, once for both engines. ``train_batch`` receives this rank's share of one
mini-batch, splits it into micro-batches, and back-propagates ``loss_fn(...) * micro_rows /
mini_rows`` for each; the data-parallel gradient reduction then *averages* over the ``dp_size``
ranks. So a loss_fn that returns a per-micro-batch mean trains on the row-weighted mean of those
means (verl's classic behaviour). The losses hybridflow ships aggregate over the whole mini-batch
on all ranks instead (hybridflow/algorithms/mini_batch_agg.py): they undo both factors with the
numbers the engine puts into every micro-batch's ``meta_info`` (``mini_batch_meta``).

``train_batch(..., skip_rows=)`` leaves out rows whose loss and gradient are identically zero
(``compact_rows``); with a whole-mini-batch loss that gives the same step, for less compute.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Iterator, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

# The meta_info keys train_batch adds to every micro-batch (re-exported for loss functions).
from hybridflow.algorithms.mini_batch_agg import (  # noqa: F401
    META_DP_SIZE, META_GLOBAL_NONEMPTY_ROWS, META_GLOBAL_ROWS, META_GLOBAL_TOKENS, META_MINI_BATCH_ROWS,
    mini_batch_agg,
)
from hybridflow.algorithms.diagnostics import combine_metric
from workers.engines.config import EngineConfig

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
    weights_version: int  # +1 at every optimizer step that changed the weights and every load

    def __init__(self, config: EngineConfig, model_path: str, role: str) -> None: ...

    def compute_log_prob(self, data, temperature: float,
                         calculate_entropy: bool = False) -> tuple[Tensor, Tensor | None]: ...

    def compute_values(self, data) -> Tensor: ...

    def train_batch(self, data, loss_fn: LossFn, skip_rows: Tensor | None = None) -> dict[str, float]: ...

    def export_hf_weights(self) -> Iterator[tuple[str, Tensor]]: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def save_hf(self, path: str) -> None: ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...

    def params_on_device(self) -> ContextManager[None]: ...


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


def real_columns(attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's first real column and one past its last (prompts left-padded, responses
    right-padded)."""
    real = attention_mask.bool()
    return real.int().argmax(-1), real.shape[1] - real.flip(-1).int().argmax(-1)


def mini_batch_token_mean(token_values: Tensor, mask: Tensor, micro_batch) -> Tensor:
    """Micro-batch loss whose accumulated, DP-averaged gradient is that of the token mean of
    ``token_values`` over the *whole* mini-batch on all ranks (``mini_batch_agg``, token-mean)."""
    return mini_batch_agg(token_values, mask, "token-mean", micro_batch.meta_info, len(micro_batch))


def response_mask_of(data) -> Tensor:
    batch = data.batch
    if "response_mask" in batch.keys():
        return batch["response_mask"]
    return batch["attention_mask"][:, -batch["responses"].shape[1]:]


def mini_batch_meta(data, dp_size: int, group, device) -> dict:
    """The mini-batch totals over all data-parallel ranks (one all-reduce), for meta_info."""
    mask = response_mask_of(data)
    local = torch.tensor([float(mask.sum()), float(len(data)), float((mask.sum(-1) > 0).sum())],
                         dtype=torch.float64, device=device)
    dist.all_reduce(local, group=group)
    tokens, rows, nonempty = (int(v) for v in local.tolist())
    return {META_DP_SIZE: dp_size, META_GLOBAL_TOKENS: tokens, META_GLOBAL_ROWS: rows,
            META_GLOBAL_NONEMPTY_ROWS: nonempty}


def compact_rows(data, skip_rows: Tensor | None, group, device):
    """This rank's rows minus ``skip_rows`` (rows whose loss and gradient are identically zero),
    padded so that every data-parallel rank trains the same number of rows; None when no rank
    has a row left.

    The same row count everywhere keeps the micro-batch count, and so the collectives inside
    forward and backward (FSDP all-gathers, DDP's reduction, pipeline sends), in step across
    ranks. A padding row is a copy of a real row with its response mask zeroed: it runs through
    the model, but every loss masks it out, so it adds exactly 0 to the gradient. Totals for the
    loss denominators must be taken before this (``mini_batch_meta``).
    """
    if skip_rows is None:
        return data
    keep = torch.nonzero(~skip_rows.bool().cpu()).flatten()
    count = torch.tensor([len(keep)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    target = int(count.item())
    if target == 0:
        return None
    if len(keep) == len(data):
        return data
    pad = target - len(keep)
    index = torch.cat([keep, torch.zeros(pad, dtype=torch.long) + (keep[0] if len(keep) else 0)])
    out = data[index]
    if pad:
        mask = out.batch["response_mask"].clone()
        mask[len(keep):] = 0
        out.batch["response_mask"] = mask
    return out


def real_rows(micro) -> int:
    """Rows of a micro-batch that are not padding from ``compact_rows`` (metrics are weighted by it)."""
    return int((response_mask_of(micro).sum(-1) > 0).sum())


def local_metric_means(micros, results) -> tuple[dict[str, float], int]:
    """Each metric's mean over this rank's micro-batches weighted by their real rows, and the
    real-row count (which counts every micro-batch, also where ``results`` are missing: a
    pipeline's earlier stages have none)."""
    weights = [real_rows(micro) for micro in micros]
    total = sum(weights)
    parts = list(zip(weights, results)) + [(w, {}) for w in weights[len(results):]]
    return (_combine(parts) if total else {}), total


def mean_over_ranks(metrics: dict[str, float], rows: int, dp_size: int, group) -> tuple[dict[str, float], int]:
    """Row-weighted mean of each metric over the data-parallel ranks (the same dict everywhere),
    and the rows over all of them."""
    gathered: list = [None] * dp_size
    dist.all_gather_object(gathered, (rows, metrics), group=group)
    total = sum(r for r, _ in gathered)
    return (_combine(gathered) if total else {}), total


def _combine(weighted: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Each metric over (weight, metrics) parts (``combine_metric``: the weighted mean, or a
    ``_max`` metric's maximum). A part without the metric counts as 0 in the mean: its rows had none."""
    total = sum(w for w, _ in weighted)
    out = {}
    for key in sorted(set().union(*(m.keys() for _, m in weighted))):
        present = [(w, float(m[key])) for w, m in weighted if key in m]
        out[key] = combine_metric(key, [v for _, v in present], [w for w, _ in present], total)
    return out


def refuse_padded_rows(data, dp_size: int) -> None:
    """A training step on a batch the controller padded to split over the data-parallel ranks would
    train the copied rows twice (no error, just a biased update): refuse it, on every rank alike
    (each part carries the marker). Log-prob and generation calls are fine: their padding is
    stripped from the outputs."""
    from hybridflow.protocol import DP_PADDING_ROWS

    pad = data.meta_info.get(DP_PADDING_ROWS)
    if pad:
        raise ValueError(f"train_batch: the controller padded this batch with {pad} copied rows to split it over "
                         f"{dp_size} data-parallel ranks, so those rows would train twice; send a multiple of "
                         f"{dp_size} rows (the recipes' trainer always does)")


def skipped_rows_frac(meta: dict, trained_rows: int) -> float:
    """Share of the mini-batch's rows (all ranks) that ``compact_rows`` left out."""
    return 1.0 - trained_rows / max(meta[META_GLOBAL_ROWS], 1)
