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
each, which costs little where answers are long and prompts short (the case this is for); with
long prompts and short answers, leave it off. Forward-only passes give their results back in the
caller's order. A training step's loss is aggregated over the whole mini-batch
(algorithms/mini_batch_agg.py) and its metrics are row-weighted means, so the order changes no
number beyond fp32 summation order.
"""
from __future__ import annotations

import torch
from torch import Tensor


def length_order(data) -> Tensor | None:
    """The permutation that puts ``data``'s rows into micro-batch order (``data[order]``), or None
    where that is the order they are in.

    A row's length is where its last real token ends (responses are right-padded); rows share a
    prompt when their prompt columns (token ids and mask) agree."""
    mask = data.batch["attention_mask"].bool()
    rows, cols = mask.shape
    if rows < 2:
        return None
    prompt_cols = cols - data.batch["responses"].shape[1]
    end = cols - mask.flip(-1).int().argmax(-1)  # one past the last real column
    prompt_mask = mask[:, :prompt_cols].long()
    key = torch.cat([data.batch["input_ids"][:, :prompt_cols] * prompt_mask, prompt_mask], dim=1)
    _, group = torch.unique(key, dim=0, return_inverse=True)
    index = torch.arange(rows)
    group_first = torch.full((int(group.max()) + 1,), rows).scatter_reduce(0, group, index, "amin")
    # stable sorts from the least significant key up: (row's end, its prompt's first row, row)
    order = index[torch.sort(group_first[group], stable=True).indices]
    order = order[torch.sort(end[order], stable=True).indices]
    return None if torch.equal(order, index) else order


def restore_order(order: Tensor | None, values: Tensor) -> Tensor:
    """``values`` computed on ``data[order]``, back in ``data``'s row order."""
    if order is None:
        return values
    return values[torch.argsort(order).to(values.device)]
