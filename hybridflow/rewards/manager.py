"""Scoring a batch of decoded responses into token-level scores.

Tokenizer-free: the caller decodes responses and passes the strings plus each response's length
in tokens. The score of a response goes on its last token (index length - 1), as the advantage
estimators expect (outcome reward). A reward function that raises on one sample never stops the
run: that sample scores 0.0, the exception is counted in the metric `reward/errors`, and the
first few are logged with the sample index. One that raises on every sample of a batch (of two or
more) is broken, not flaky: training on all-zero scores would only waste the run, so that raises
RewardFunctionError with the first exception.

With ``timeout_s`` (``custom_reward_function.timeout_s``) each call runs in a child process and
is cut at that limit (scoring_process.py says why a process): that sample scores 0.0 and is
counted in `reward/timeouts`; a call running past min(10 s, half the limit) is warned about
while it runs. A stop (SIGTERM's ``Terminated``, Ctrl-C) derives from BaseException and is never
caught here: it stops the run, whatever the reward function was doing.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Sequence

import torch
from torch import Tensor

from hybridflow.rewards.loader import RewardFunctionError, load_reward_function
from hybridflow.rewards.registry import ComputeScoreFn, default_compute_score
from hybridflow.rewards.scoring_process import CallOutcome, ScoringProcess

logger = logging.getLogger(__name__)


@dataclass
class RewardResult:
    token_level_scores: Tensor  # [B, R] float32, score on each response's last token
    scores: list[float]  # [B]
    extra: dict[str, list[Any]] = field(default_factory=dict)  # dict results' other keys, per sample (None if absent)
    metrics: dict[str, float] = field(default_factory=dict)


def _as_score(result: Any) -> tuple[float, dict[str, Any]]:
    """Split a reward function's result into (score, extra fields); raise on a malformed one."""
    extra: dict[str, Any] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"reward function returned a dict without a 'score' key: keys {sorted(result)}")
        extra = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    if isinstance(result, Tensor) and result.numel() == 1:
        result = result.item()
    if not isinstance(result, Real):
        raise TypeError(f"reward function returned {type(result).__name__}, expected a number or a dict with 'score'")
    score = float(result)
    if not math.isfinite(score):
        raise ValueError(f"reward function returned a non-finite score {score}")
    return score, extra


REWARD_MANAGERS = ("naive", "batch", "dapo")


def overlong_penalty(length: int, max_length: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by ``factor``: 0 up to
    ``max_length - buffer`` tokens, then falling linearly to ``-factor`` at ``max_length``.
    Responses are cut at ``max_length``, so the paper's -1 beyond it is the same end point."""
    return min(-(length - (max_length - buffer)) / buffer * factor, 0.0)


# A function that raised on every sample of whole batches, this many samples in a row, is broken
# rather than flaky, and all-zero scores would train on nothing: the run stops. Counting across
# batches keeps small batches (val_batch_size=1) of a flaky function from stopping it by chance.
# A call cut at the time limit counts as raising here: a function that never answers in time
# (a grader service that is down) is as broken.
STOP_AFTER_RAISING = 8
# without a time limit, a call slower than this is reported when it returns
SLOW_CALL_S = 10.0


class RewardManager:
    """Calls `compute_score(data_source, solution_str, ground_truth, extra_info)` per sample
    (verl's ``naive`` manager), or once per batch with lists (``batched``, verl's ``batch``:
    `compute_score(data_sources, solution_strs, ground_truths, extra_infos)` returns one result
    per sample, for scorers that vectorise or call a service once). A batch call that raises
    fails the step, since no sample of it has a score. ``overlong_buffer`` adds DAPO's length
    penalty to each score (verl's ``dapo`` manager: per sample, as ``naive``). ``timeout_s``
    bounds each call in a child process (None: calls run here, unbounded)."""

    def __init__(self, compute_score: ComputeScoreFn | None = None, max_logged_errors: int = 3,
                 batched: bool = False, overlong_buffer: tuple[int, float] | None = None,
                 timeout_s: float | None = None):
        if batched and compute_score is None:
            raise RewardFunctionError("reward_model.reward_manager=batch calls custom_reward_function with "
                                      "whole lists: set custom_reward_function.path")
        self.compute_score = compute_score or default_compute_score
        self.batched = batched
        self.overlong_buffer = overlong_buffer  # (buffer length, penalty factor): verl's dapo manager
        self.max_logged_errors = max_logged_errors
        self.timeout_s = timeout_s
        self._process = ScoringProcess(self.compute_score, timeout_s) if timeout_s is not None else None
        self._logged_errors = 0  # over this manager's lifetime, so a bad function cannot flood logs
        self._raising_in_a_row = 0  # samples of whole batches that all raised, back to the last success

    def __call__(self, responses: Sequence[str], response_lengths: Sequence[int] | Tensor,
                 max_response_length: int, data_sources: Sequence[str], ground_truths: Sequence[Any],
                 extra_infos: Sequence[dict | None] | None = None) -> RewardResult:
        batch = len(responses)
        lengths = [int(n) for n in (response_lengths.tolist() if isinstance(response_lengths, Tensor)
                                    else response_lengths)]
        extra_infos = [None] * batch if extra_infos is None else list(extra_infos)
        for name, column in (("response_lengths", lengths), ("data_sources", data_sources),
                             ("ground_truths", ground_truths), ("extra_infos", extra_infos)):
            if len(column) != batch:
                raise ValueError(f"reward: {name} has {len(column)} entries for {batch} responses")
        bad = [n for n in lengths if not 0 <= n <= max_response_length]
        if bad:
            raise ValueError(f"reward: response length {bad[0]} outside [0, max_response_length={max_response_length}]")

        if self.batched:
            outcomes = self._call_batched(responses, data_sources, ground_truths, extra_infos)
        else:
            outcomes = self._call_each([dict(data_source=data_sources[i], solution_str=responses[i],
                                             ground_truth=ground_truths[i], extra_info=extra_infos[i])
                                        for i in range(batch)])
        scores: list[float] = []
        extras: list[dict[str, Any]] = []
        errors, timeouts, first_error = 0, 0, None
        for i, outcome in enumerate(outcomes):
            score, extra, error = 0.0, {}, outcome.error
            if outcome.timed_out:
                timeouts += 1
                if not self.batched or i == 0:  # a batch call timed out once, for all its samples
                    self._log_timeout(i, data_sources[i])
            elif error is None:
                try:  # a batch result is checked like a per-sample one (malformed: 0.0, counted)
                    score, extra = _as_score(outcome.result)
                except Exception as exc:
                    error = exc
            if error is not None:
                errors += 1
                first_error = first_error or error
                score, extra = 0.0, {}
                self._log_error(i, data_sources[i], error)
            scores.append(score)
            extras.append(extra)
        self._check_not_broken(batch, errors + timeouts, first_error)

        penalties = None
        if self.overlong_buffer is not None:
            buffer, factor = self.overlong_buffer
            penalties = [overlong_penalty(n, max_response_length, buffer, factor) for n in lengths]
            # per sample, as verl's dapo manager reports them, plus the score before the penalty:
            # validation (which the penalty applies to as well) then still shows the task's score
            for extra, score, penalty in zip(extras, scores, penalties):
                extra.setdefault("task_score", score)
                extra.setdefault("overlong_reward", penalty)
                extra.setdefault("overlong", penalty < 0)
            scores = [score + penalty for score, penalty in zip(scores, penalties)]

        token_level_scores = torch.zeros(batch, max_response_length, dtype=torch.float32)
        for i, (score, n) in enumerate(zip(scores, lengths)):
            # an empty response has no token; its score sits on position 0 (masked out downstream)
            if max_response_length > 0:
                token_level_scores[i, max(n - 1, 0)] = score

        keys = sorted({k for extra in extras for k in extra})
        extra_columns = {k: [extra.get(k) for extra in extras] for k in keys}
        metrics = self._metrics(scores, data_sources, extra_columns, errors)
        metrics["reward/timeouts"] = float(timeouts)
        if penalties is not None:
            metrics["reward/overlong_penalty/mean"] = sum(penalties) / batch
            metrics["reward/overlong/frac"] = sum(p < 0 for p in penalties) / batch
        return RewardResult(token_level_scores, scores, extra_columns, metrics)

    def _check_not_broken(self, batch: int, failed: int, first_error: BaseException | None) -> None:
        """Raise once whole batches failed (raised or timed out), STOP_AFTER_RAISING samples in a row."""
        self._raising_in_a_row = self._raising_in_a_row + batch if failed == batch else 0
        if failed == batch and self._raising_in_a_row >= STOP_AFTER_RAISING:
            streak = f" ({self._raising_in_a_row} in a row)" if self._raising_in_a_row > batch else ""
            first = (f"first {type(first_error).__name__}: {first_error}" if first_error is not None else
                     f"each call cut at custom_reward_function.timeout_s={self.timeout_s:g}")
            verb = "raised" if first_error is not None else "timed out"
            raise RewardFunctionError(
                f"the reward function {verb} on all {batch} samples of a batch{streak}, {first}; fix "
                "custom_reward_function (path/name/timeout_s) or the function") from first_error

    def _call_each(self, calls: list[dict]) -> list[CallOutcome]:
        """One outcome per sample: in the child process when bounded, else here (only Exception
        is the sample's: a stop, BaseException, passes)."""
        if self._process is not None:
            return self._process.call_each(calls, lambda i: f"sample {i} (data_source="
                                                            f"{calls[i]['data_source']!r})")
        return [self._call_here(kwargs, f"sample {i} (data_source={kwargs['data_source']!r})")
                for i, kwargs in enumerate(calls)]

    def _call_here(self, kwargs: dict, what: str) -> CallOutcome:
        """``compute_score(**kwargs)`` in this process, unbounded; reported when it returns if slow."""
        started = time.monotonic()
        try:
            outcome = CallOutcome(result=self.compute_score(**kwargs))
        except Exception as exc:
            outcome = CallOutcome(error=exc)
        took_s = time.monotonic() - started
        if took_s >= SLOW_CALL_S:
            logger.warning("reward function slow: %s took %.0f s (no time limit: custom_reward_function."
                           "timeout_s=null)", what, took_s)
        return outcome

    def _call_batched(self, responses, data_sources, ground_truths, extra_infos) -> list[CallOutcome]:
        """One call for the batch: an outcome per response (each timed out if the call was)."""
        kwargs = dict(data_sources=list(data_sources), solution_strs=list(responses),
                      ground_truths=list(ground_truths), extra_infos=list(extra_infos))
        what = f"the batch call ({len(responses)} samples)"
        outcome = (self._process.call_once(kwargs, what) if self._process is not None
                   else self._call_here(kwargs, what))
        if outcome.timed_out:
            return [outcome] * len(responses)
        if outcome.error is not None:
            exc = outcome.error
            raise RewardFunctionError(f"the batch reward function raised {type(exc).__name__}: {exc}; fix "
                                      "custom_reward_function or use reward_model.reward_manager=naive") from exc
        results = outcome.result
        if isinstance(results, Tensor):
            results = results.tolist()
        if not isinstance(results, Sequence) or isinstance(results, str) or len(results) != len(responses):
            got = f"{len(results)} results" if isinstance(results, Sequence) else type(results).__name__
            raise RewardFunctionError(f"reward_model.reward_manager=batch: the reward function returned {got} "
                                      f"for {len(responses)} responses; return one score (or dict) per response")
        return [CallOutcome(result=r) for r in results]

    def close(self) -> None:
        """Stop the scoring child process, if one runs (a later call starts another)."""
        if self._process is not None:
            self._process.close()

    def _log_timeout(self, index: int, data_source: Any) -> None:
        """Every timeout is logged: each one cost the step timeout_s seconds, so they are few."""
        logger.warning("reward function timed out on sample %d (data_source=%r) after custom_reward_function."
                       "timeout_s=%g; scored 0.0 (counted in reward/timeouts)", index, data_source, self.timeout_s)

    def _log_error(self, index: int, data_source: Any, exc: BaseException) -> None:
        if self._logged_errors < self.max_logged_errors:
            logger.warning("reward function raised on sample %d (data_source=%r); scored 0.0: %s: %s",
                           index, data_source, type(exc).__name__, exc, exc_info=exc)
        elif self._logged_errors == self.max_logged_errors:
            logger.warning("further reward function errors are only counted in reward/errors")
        self._logged_errors += 1

    @staticmethod
    def _metrics(scores: list[float], data_sources: Sequence[str], extra_columns: dict[str, list[Any]],
                 errors: int) -> dict[str, float]:
        metrics = {"reward/errors": float(errors)}
        if scores:
            metrics["reward/score/mean"] = sum(scores) / len(scores)
        for source in sorted({str(s) for s in data_sources}):
            picked = [s for s, src in zip(scores, data_sources) if str(src) == source]
            metrics[f"reward/score/{source}/mean"] = sum(picked) / len(picked)
        for key, column in extra_columns.items():
            numbers = [float(v) for v in column if isinstance(v, Real)]
            if numbers:
                metrics[f"reward/{key}/mean"] = sum(numbers) / len(numbers)
        return metrics


SAMPLE_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


def check_signature(fn, name: str, batched: bool) -> None:
    """The manager calls the function with these keywords (verl's): refuse one that cannot take
    them now, before Ray starts, rather than at the first scored batch."""
    args = BATCH_ARGS if batched else SAMPLE_ARGS
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    try:
        signature.bind(**dict.fromkeys(args))
    except TypeError as exc:
        manager = "reward_model.reward_manager=batch" if batched else "the per-sample reward manager"
        raise RewardFunctionError(
            f"custom_reward_function.name: {name}{signature} cannot be called as {name}({', '.join(args)}) "
            f"({exc}), as {manager} calls it: give it those parameters (extra_info=None if unused)") from None


def make_reward_manager(custom_path: str | None = None, custom_name: str = "compute_score",
                        reward_kwargs: dict[str, Any] | None = None,
                        max_logged_errors: int = 3, manager: str = "naive",
                        overlong_buffer: tuple[int, float] | None = None,
                        timeout_s: float | None = None) -> RewardManager:
    """From the `custom_reward_function` config group: the user's function when `path` is set,
    else the built-in dispatcher by data_source; `manager` is `reward_model.reward_manager`, and
    `overlong_buffer` (length, penalty factor) the dapo manager's `reward_model.overlong_buffer`;
    `timeout_s` is `custom_reward_function.timeout_s` (None: no limit, calls run in this process)."""
    if manager not in REWARD_MANAGERS:
        raise ValueError(f"reward_model.reward_manager={manager!r} is unknown: use one of {REWARD_MANAGERS}")
    if overlong_buffer is not None and manager != "dapo":
        raise ValueError("reward_model.overlong_buffer is the dapo manager's: set reward_model.reward_manager=dapo")
    fn = load_reward_function(custom_path, custom_name, reward_kwargs) if custom_path else None
    if fn is not None:
        check_signature(fn, custom_name, batched=manager == "batch")
    return RewardManager(fn, max_logged_errors=max_logged_errors, batched=manager == "batch",
                         overlong_buffer=overlong_buffer, timeout_s=timeout_s)
