"""DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2; verl's ``algorithm.filter_groups``).

A prompt whose samples all score the same (all right or all wrong) has zero group-relative
advantage everywhere: it adds no gradient, only shrinks the batch's effective size. Dynamic
sampling drops those prompts and generates more batches until ``data.train_batch_size``
informative prompts are collected (eq. 11's constraint ``0 < |{o_i correct}| < G``), then trains
on exactly that many. ``skip_zero_advantage`` already avoids *computing* such rows; this keeps
the number of rows that *learn* constant.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

FILTER_METRICS = ("seq_reward", "score", "acc")


class DynamicSamplingError(RuntimeError):
    """The generation-batch budget ran out before enough informative prompts were found."""


def metric_values(metric: str, scores: Sequence[float], extra: dict[str, list]) -> np.ndarray:
    """Per-row values whose spread within a prompt decides whether it is kept: the score
    (``seq_reward`` / ``score``) or the reward function's ``acc`` field."""
    if metric in ("seq_reward", "score"):
        return np.asarray(scores, dtype=np.float64)
    column = extra.get(metric)
    if column is None or any(v is None for v in column):
        raise DynamicSamplingError(f"algorithm.filter_groups.metric={metric}: the reward function returned no "
                                   f"{metric!r} field for every response; return a dict with it, or use "
                                   "metric=seq_reward")
    return np.asarray(column, dtype=np.float64)


def informative_rows(uids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Bool mask of the rows whose prompt's values differ (or that are its only sample)."""
    groups: dict = {}
    for uid, value in zip(uids, values):
        groups.setdefault(uid, []).append(value)
    keep = {uid: len(v) == 1 or float(np.std(v)) > 0 for uid, v in groups.items()}
    return np.array([keep[uid] for uid in uids], dtype=bool)
