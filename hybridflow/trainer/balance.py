"""``trainer.balance_batch``: order a step's rows so every data-parallel rank gets a similar
number of tokens.

The worker group hands rank ``r`` the ``r``-th of ``dp`` equal chunks of the batch; the step
waits for the rank with the most tokens. verl sorts single rows into the chunks
(Karmarkar-Karp). What differs here: a prompt's samples (rows sharing a ``uid``) stay together,
in their order, because the engines run each distinct prompt of a micro-batch once
(``share_prompt_prefix``) and GRPO's groups are scored together; rows are placed one by one only
when the groups cannot be split evenly over the ranks. The placement is greedy longest-first
with equal counts per rank (Graham's LPT rule, 1969): at most 4/3 of the optimum, and exact
enough for batches of tens to thousands of groups.
"""
from __future__ import annotations

import heapq

import numpy as np
import torch


def _units(uids: np.ndarray, parts: int) -> list[list[int]]:
    """Runs of consecutive rows with one uid (a prompt's samples), or single rows when the runs
    cannot be dealt out evenly."""
    runs: list[list[int]] = []
    for row, uid in enumerate(uids):
        if runs and uids[runs[-1][0]] == uid:
            runs[-1].append(row)
        else:
            runs.append([row])
    if len(runs) % parts or len({len(r) for r in runs}) != 1:
        return [[row] for row in range(len(uids))]
    return runs


def balanced_order(tokens: torch.Tensor, uids: np.ndarray, parts: int) -> tuple[torch.Tensor, dict[str, float]]:
    """(a permutation of the rows, metrics). ``tokens[i]``: row ``i``'s token count; ``parts``:
    the data-parallel ranks, which must divide the row count."""
    rows = len(tokens)
    if parts < 1 or rows % parts:
        raise ValueError(f"balance_batch: {rows} rows do not split over {parts} data-parallel ranks")
    units = _units(uids, parts)
    cost = [float(tokens[u].sum()) for u in units]
    per_part = len(units) // parts
    heap = [(0.0, part) for part in range(parts)]  # (load, part) of the parts with room left
    members: list[list[int]] = [[] for _ in range(parts)]
    for unit in sorted(range(len(units)), key=lambda u: (-cost[u], u)):
        load, part = heapq.heappop(heap)
        members[part].append(unit)
        if len(members[part]) < per_part:
            heapq.heappush(heap, (load + cost[unit], part))
    order = [row for part in members for unit in sorted(part) for row in units[unit]]
    before = tokens.view(parts, -1).sum(-1).float()
    after = torch.tensor([sum(cost[u] for u in part) for part in members])
    metrics = {"global_seqlen/min": float(after.min()), "global_seqlen/max": float(after.max()),
               "global_seqlen/minmax_diff": float(after.max() - after.min()),
               "global_seqlen/unbalanced_max": float(before.max()), "global_seqlen/mean": float(after.mean())}
    return torch.tensor(order), metrics
