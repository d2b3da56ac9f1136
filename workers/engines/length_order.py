"""Micro-batches of similar lengths (``model.group_by_length``): a rank's rows reordered before
they are cut into micro-batches, so that each micro-batch holds rows of similar lengths.

The padded layout cuts each micro-batch to the columns its rows span (``base.active_span``), so a
micro-batch costs what its longest row costs. In batch order a long-tailed batch puts a long
answer into nearly every micro-batch: with 40% of the answers at the length limit, 87% of the
4-row micro-batches run to the limit. In length order the long rows share micro-batches and the
short ones run short. Token-budget micro-batches (``use_dynamic_bsz``) gain the same way: sorted
rows fill a budget with fewer, fuller micro-batches. verl's ``use_dynamic_bsz`` reorders rows
inside the step too (by token count, to balance its micro-batches); HF's and TRL's
``group_by_length`` sort the dataset instead.

Rows go by where their last real token ends; rows of equal length go by prompt (the first row of
their prompt, then their own position), so a prompt's samples of one length sit together and the
shared-prompt forward (prefix_sharing.py) still runs their prompt once per micro-batch. Samples of
one prompt with different lengths land in different micro-batches: the prompt then runs once in
each, which costs little where answers are long and prompts short, and can cost several times
what the order saves where prompts are long and answers short. So the order is taken only where
it feeds the model fewer token positions than batch order (:func:`padded_positions`, counted as
the engines cut and share), rank by rank and call by call. Forward-only passes give their results
back in the caller's order. A training step's loss is aggregated over the whole mini-batch
(algorithms/mini_batch_agg.py) and its metrics are row-weighted means, so the order changes no
number beyond fp32 summation order.
"""
from __future__ import annotations

import torch
from torch import Tensor

from workers.engines.base import real_columns
from workers.engines.prefix_sharing import distinct_prompts, saves_enough
from workers.engines.token_budget import groups_within


class _Rows:
    """Each row's first real column and one past its last, and its prompt number (as the
    shared-prompt forward counts prompts), with each prompt's first row: computed once per call."""

    def __init__(self, data):
        b = data.batch
        mask = b["attention_mask"]
        self.prompt_len = mask.shape[1] - b["responses"].shape[1]
        self.first, self.last = real_columns(mask)
        self.first_rows, self.group = distinct_prompts(b["input_ids"], mask, b["position_ids"], 0, self.prompt_len)


def length_order(data, layout: _Rows | None = None) -> Tensor | None:
    """The permutation that puts ``data``'s rows into micro-batch order (``data[order]``), or None
    where that is the order they are in.

    A row's length is where its last real token ends (responses are right-padded); rows share a
    prompt as the shared-prompt forward counts it (``prefix_sharing.distinct_prompts``)."""
    n = len(data)
    if n < 2:
        return None
    layout = layout or _Rows(data)
    index = torch.arange(n)
    # stable sorts from the least significant key up: (row's end, its prompt's first row, row)
    order = index[torch.sort(layout.first_rows[layout.group], stable=True).indices]
    order = order[torch.sort(layout.last[order], stable=True).indices]
    return None if torch.equal(order, index) else order


def padded_positions(data, order: Tensor | None, rows: int, max_tokens: int | None, share: bool,
                     layout: _Rows | None = None) -> int:
    """Token positions the micro-batches of ``data[order]`` feed the model, as the engines cut them
    (``rows`` per micro-batch, or by ``max_tokens``: ``token_budget``) and run them: each over the
    columns its rows span (``base.active_span``; the last column is never an input), and with
    ``share``, each distinct prompt once when that saves enough (``prefix_sharing.saves_enough``).
    A linear count: attention's quadratic part is small beside the linear layers at RL lengths."""
    layout = layout or _Rows(data)
    prompt_len, first, last, group = layout.prompt_len, layout.first, layout.last, layout.group
    if order is not None:
        first, last, group = first[order], last[order], group[order]
    n = len(first)
    sizes = [min(rows, n - s) for s in range(0, n, rows)] if max_tokens is None else \
        groups_within(list(zip(first.tolist(), last.tolist())), max_tokens)
    total, at = 0, 0
    for size in sizes:
        part = slice(at, at + size)
        at += size
        start = min(int(first[part].min()), prompt_len - 1)
        end = max(int(last[part].max()), prompt_len + 1)
        fed = size * (end - 1 - start)
        if share:
            prompts = torch.unique(group[part])
            if saves_enough(prompts, size, prompt_len - start, end - 1 - start):
                fed -= (size - len(prompts)) * (prompt_len - start)
        total += fed
    return total


def in_length_order(data, enabled: bool, rows: int, max_tokens: int | None, share: bool):
    """``(data in micro-batch order, the permutation or None)``: the engines' one call, before they
    cut micro-batches (``enabled``: ``EngineConfig.group_by_length``; ``rows``, ``max_tokens`` and
    ``share`` as :func:`padded_positions`). Length order is taken only where it feeds the model
    fewer positions than the order the rows came in."""
    if not enabled or data is None or len(data) < 2:
        return data, None
    layout = _Rows(data)
    order = length_order(data, layout)
    if order is None or padded_positions(data, order, rows, max_tokens, share, layout) >= \
            padded_positions(data, None, rows, max_tokens, share, layout):
        return data, None
    return data[order], order


def restore_order(order: Tensor | None, values: Tensor) -> Tensor:
    """``values`` computed on ``data[order]``, back in ``data``'s row order."""
    if order is None:
        return values
    return values[torch.argsort(order).to(values.device)]
