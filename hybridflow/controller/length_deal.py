"""Dealing a batch's prompts to generation ranks by their expected answer length (sample
reallocation's ``deal_by_length``: hybridflow/config/reallocation.py), so that no rank is dealt
the long answers of the others. GenerationStream (hybridflow/controller/stream.py) deals by it
when given ``lengths``; the trainer's lengths are each prompt's answers at its last generation
(hybridflow/trainer/reallocated_rollout.py ``AnswerLengths``)."""
from __future__ import annotations

import numpy as np


def deal_by_length(lengths, parts: int) -> list[list[int]] | None:
    """Prompt indices per share when each prompt's answer length is expected: sorted longest
    first and dealt in a snake (0, 1, ..., parts-1, parts-1, ..., 0, ...), so every share holds as
    many prompts (to one) and the same mix of long and short ones; within a share the longest
    come first, so an engine that cannot run all at once starts them first (longest processing
    time first). Why not balance total tokens, as load balancers do: a decode step's cost is
    mostly per step, not per sequence (docs/benchmarks.md, sample reallocation), so a rank's time
    is set by how long its longest answers run and how many run beside them, and three long
    answers against forty short ones of the same total would leave the first rank last. NaN (not
    known) counts as the median of the known lengths; none known: None (no basis to deal on)."""
    values = np.asarray(lengths, dtype=float)
    known = values[~np.isnan(values)]
    if not len(known):
        return None
    values = np.where(np.isnan(values), float(np.median(known)), values)
    order = np.argsort(-values, kind="stable")  # ties keep the batch's order
    shares: list[list[int]] = [[] for _ in range(parts)]
    for position, index in enumerate(order.tolist()):
        lap, seat = divmod(position, parts)
        shares[seat if lap % 2 == 0 else parts - 1 - seat].append(index)
    return shares
