"""What validation logs: the mean score, per data source, and with ``val_kwargs.n > 1`` samples per
prompt the per-prompt statistics verl reports.

Each metric is computed per prompt over its N samples, then averaged over prompts:
``mean@N`` (the sample mean), ``std@N`` (population std), ``best@N`` / ``worst@N`` (the highest
and lowest score among the N: best@N of a 0/1 reward is pass@N) and, when the reward function
returns a ``pred`` field (verl's convention for the extracted answer), ``maj@N``: the score of the
answer most samples agree on (ties go to the first answer drawn).

Where this differs from verl: verl estimates best@k and maj@k for k < N by bootstrap resampling
and names keys ``val-core/<source>/reward/mean@N``. Here each statistic is exact at k = N only, and
keys keep this project's ``val/<var>/...`` names: ``val/score/mean@4``,
``val/score/gsm8k/best@4``. Every numeric field of a reward function's dict besides ``score``
(``acc``, say) gets the same treatment under ``val/<field>/...``; samples where the field is
missing (the reward function raised on them, say) are left out of its averages.
"""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Any, Sequence

import numpy as np


def validation_metrics(scores: Sequence[float], sources: Sequence[str], n: int,
                       extra: dict[str, Sequence[Any]] | None = None) -> dict[str, float]:
    """Metrics for samples laid out prompt by prompt, ``n`` consecutive samples per prompt (the
    order ``batch.repeat(n, interleave=True)`` produces). ``extra``: the reward function's extra
    fields, one list per field, aligned with ``scores``."""
    if n < 1 or len(scores) % n or len(sources) != len(scores):
        raise ValueError(f"validation: {len(scores)} scores and {len(sources)} sources do not make "
                         f"whole groups of n={n} samples per prompt")
    extra = extra or {}
    variables = {"score": list(scores)}
    for key, values in extra.items():
        if (key not in ("score", "pred") and len(values) == len(scores) and any(_is_number(v) for v in values)
                and all(v is None or _is_number(v) for v in values)):
            variables[key] = [np.nan if v is None else float(v) for v in values]
    preds = extra.get("pred")
    preds = list(preds) if preds is not None and len(preds) == len(scores) else None

    groups = range(0, len(scores), n)
    group_source = [sources[g] for g in groups]
    out: dict[str, float] = {}
    with warnings.catch_warnings():  # a source or prompt whose field is all missing: nan, left out above it
        warnings.simplefilter("ignore", RuntimeWarning)
        for name, values in variables.items():
            values = np.asarray(values, dtype=np.float64)
            _put(out, f"val/{name}/mean", np.nanmean(values))
            for src in sorted(set(sources)):
                _put(out, f"val/{name}/{src}/mean", np.nanmean(values[[s == src for s in sources]]))
            if n == 1:
                continue
            per_prompt = _per_prompt(values.reshape(-1, n), [preds[g:g + n] for g in groups] if preds else None)
            for stat, column in per_prompt.items():
                _put(out, f"val/{name}/{stat}@{n}", np.nanmean(column))
                for src in sorted(set(group_source)):
                    _put(out, f"val/{name}/{src}/{stat}@{n}",
                         np.nanmean([v for v, s in zip(column, group_source) if s == src]))
    return out


def join_columns(parts: list[tuple[int, dict[str, Sequence[Any]]]]) -> dict[str, list]:
    """Per-batch extra-field columns ``(rows, {field: values})`` as one column per field; a batch
    without a field (its reward function raised on every sample) gives None for its rows, so
    the field is averaged over the other batches rather than dropped."""
    keys = sorted(set().union(*(columns for _, columns in parts)))
    return {k: [v for rows, columns in parts for v in columns.get(k, [None] * rows)] for k in keys}


def _put(out: dict, key: str, value) -> None:
    if not np.isnan(value):
        out[key] = float(value)


def _per_prompt(values: np.ndarray, preds: list[list] | None) -> dict[str, np.ndarray]:
    stats = {"mean": np.nanmean(values, 1), "std": np.nanstd(values, 1), "best": np.nanmax(values, 1),
             "worst": np.nanmin(values, 1)}
    if preds is not None:
        stats["maj"] = np.array([row[_majority(p)] for row, p in zip(values, preds)])
    return stats


def _majority(preds: list) -> int:
    """The index of the first sample whose answer is the most common one."""
    counts = Counter(str(p) for p in preds)
    top = max(counts.values())
    return next(i for i, p in enumerate(preds) if counts[str(p)] == top)


def _is_number(value: Any) -> bool:
    return isinstance(value, (bool, int, float, np.number, np.bool_))
