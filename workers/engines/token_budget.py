"""Micro-batches by token budget (verl's ``use_dynamic_bsz`` / ``*_max_token_len_per_gpu``).

Instead of a fixed number of rows, each micro-batch takes consecutive rows while its padded size,
rows x the columns they span, stays within ``max_tokens``: short sequences go through in few large
micro-batches, long ones in small ones, at a bounded activation memory.

What differs from verl: verl reorders rows by length (Karmarkar-Karp) and counts the real tokens
of a packed, padding-free batch. Here rows stay in order, so the samples of one prompt stay next to
each other for the shared-prompt forward (prefix_sharing.py), and the cost counted is the padded
one, which is what the padded layout computes. The losses are aggregated over the whole
mini-batch (algorithms/mini_batch_agg.py), so how rows are grouped changes no number.

Every data-parallel rank must run the same number of micro-batches (sharded parameters are
gathered per forward; pipeline stages exchange one activation per micro-batch): ranks with fewer
split their largest micro-batches in two until they have as many as the rank with the most.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from workers.engines.base import real_columns, split_micro_batches

_local = False  # inside ``local_plans()``: this rank plans alone


@contextmanager
def local_plans() -> Iterator[None]:
    """Plan micro-batches from this rank's rows alone, with no all-reduce of the count: for an
    inference call one rank makes while the others do something else (stream fusion's freed
    ranks, workers/engines/local_infer.py). Only valid where no forward needs the other ranks
    (FSDP replicated; Megatron TP = PP = 1): each rank then runs its own number of forwards."""
    global _local
    before, _local = _local, True
    try:
        yield
    finally:
        _local = before


def micro_batches(data, rows: int, max_tokens: int | None, group=None, device=None) -> list:
    """The engines' one way to cut a batch: ``rows`` per micro-batch, or by token budget."""
    if max_tokens is None:
        return split_micro_batches(data, rows)
    return token_budget_micro_batches(data, max_tokens, group, device)


def groups_within(spans: list[tuple[int, int]], max_tokens: int) -> list[int]:
    """Row counts of consecutive groups that fit ``max_tokens`` as the engines compute them: rows
    x the group's column span (earliest first real token to latest last one). A row wider than
    the budget goes alone."""
    sizes, rows, lo, hi = [], 0, 0, 0
    for first, last in spans:
        if rows and (rows + 1) * (max(hi, last) - min(lo, first)) > max_tokens:
            sizes.append(rows)
            rows = 0
        lo, hi = (first, last) if rows == 0 else (min(lo, first), max(hi, last))
        rows += 1
    if rows:
        sizes.append(rows)
    return sizes


def _split_to(sizes: list[int], count: int) -> list[int]:
    """Halve the largest group until there are ``count`` groups (needs ``count <= sum(sizes)``)."""
    sizes = list(sizes)
    while len(sizes) < count:
        i = max(range(len(sizes)), key=lambda j: sizes[j])
        sizes[i:i + 1] = [sizes[i] - sizes[i] // 2, sizes[i] // 2]
    return sizes


def token_budget_micro_batches(data, max_tokens: int, group=None, device=None) -> list:
    """``data`` in consecutive micro-batches of at most ``max_tokens`` padded tokens each, as many
    on every rank of ``group`` (all-reduce MAX when a process group is initialised)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: use a positive token count")
    first, last = real_columns(data.batch["attention_mask"])
    sizes = groups_within(list(zip(first.tolist(), last.tolist())), max_tokens)
    if dist.is_initialized() and not _local:
        count = torch.tensor([len(sizes)], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        if int(count) > len(data):
            raise ValueError(f"token_budget_micro_batches: another rank needs {int(count)} micro-batches but this "
                             f"one has only {len(data)} rows; give every rank the same number of rows")
        sizes = _split_to(sizes, int(count))
    parts, start = [], 0
    for size in sizes:
        part = data[start:start + size]
        part.meta_info = dict(part.meta_info)
        parts.append(part)
        start += size
    return parts
