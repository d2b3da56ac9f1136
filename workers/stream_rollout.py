"""The worker side of streaming generation with tail migration (issue 34, RLHFuse inter-stage fusion).

A mixin for the workers that hold a VLLMRollout (the hybrid ActorRolloutRefWorker and the rollout
pool's RolloutWorker). The controller (hybridflow/controller/stream.py) starts one session per
generation-DP rank, steps it in slices of engine steps, passes finished rows on while the tail
generates, and moves the unfinished samples of some ranks onto others (``stream_export`` there,
``stream_adopt`` here) so the freed ranks can compute on finished rows with their training engine.
What a session does and returns: workers/rollout/vllm_stream.py.

The host class provides two hooks: ``_enter_generation(metrics)`` puts the worker in generation
mode (the hybrid worker: weights synced into vLLM if stale, generation RNG stream) and keeps it so
across calls; ``_leave_generation()`` undoes it when the session closes (every sample returned, or
the rest exported). ``_stream_rows(rows)`` may add columns to the rows a step returns (the rollout
pool's ``rollout_weight_version``).

Every rank of a generation TP group must make the same calls with the same arguments (one engine
stepped in lockstep: same ``max_steps``, the same partials to adopt); only the group's collect rank
returns rows and partials. Streams take no partial-rollout weight switch: a session generates with
the weights it started with.

Timeline: each call is one span of the stage ``gen`` (or the ``stage`` the prompts of
``stream_start`` name), so per-step calls show as generation, one span per call.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from hybridflow.controller import Dispatch, register, spans
from hybridflow.protocol import DataProto

STAGE = "gen"


class StreamingRollout:
    _stream = None  # the open VLLMStream session, if any
    _stream_stage = STAGE
    _stream_metrics: dict | None = None  # the generation-mode metrics of the open session
    _stream_seconds = 0.0
    _stream_last_metrics: dict = {}

    # ------------------------------------------------------------------ registered methods
    @register(dispatch_mode=Dispatch.mesh("rollout"))
    def stream_start(self, prompts: DataProto) -> int:
        """Open a session and queue n samples per prompt (``prompts`` need an int64 ``row_index``
        column: the row of each prompt's first sample). Returns the samples queued on this rank."""
        self._stream_stage = prompts.meta_info.get("stage", STAGE)
        spans.relabel(self._stream_stage)
        if self._stream is not None:
            raise RuntimeError("stream_start: a stream session is already open on this worker; step it to the "
                               "end or stream_export it first")
        with self._stream_timed():
            self._open_stream()
            return self._stream_call(self._stream.start, prompts)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stream_step(self, max_steps: int) -> dict:
        """Up to ``max_steps`` engine steps. Returns {rows: the samples finished since the last call
        (DataProto with generate_sequences' columns + row_index) or None (none, or not the TP
        group's collect rank), unfinished: int, unstarted: int (of them, those with no token
        generated yet), progress: [(row_index, tokens generated, max_tokens)] of the unfinished
        ones (VLLMStream.progress; None off the collect rank), steps: int, seconds: float, done:
        bool}; with done (nothing unfinished: the session is closed) also metrics: dict. No open
        session: done."""
        spans.relabel(self._stream_stage)
        t0 = time.perf_counter()
        if self._stream is None:
            return {"rows": None, "unfinished": 0, "unstarted": 0, "progress": [], "steps": 0, "seconds": 0.0,
                    "done": True, "metrics": {}}
        with self._stream_timed():
            rows, left, steps = self._stream_call(self._stream.step, int(max_steps))
            if rows is not None:
                self._stream_rows(rows)
        out = {"rows": rows if self.rollout.is_collect else None, "unfinished": left, "steps": steps,
               "unstarted": self._stream.unstarted, "seconds": time.perf_counter() - t0, "done": left == 0,
               "progress": self._stream.progress() if self.rollout.is_collect else None}
        if left == 0:
            out["metrics"] = self._close_stream()
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stream_export(self, count: int | None = None, unstarted_only: bool = False) -> list | None:
        """Abort ``count`` unfinished samples of this rank's session (None: all of them, and the
        session closes; ``unstarted_only``: only of those with no token generated yet, and the
        session stays open; else the session stays open even if none is left: the next
        ``stream_step`` returns what adopt finished at once and closes it, as for any session).
        Returns the ``Partial``s sorted by row_index (workers/rollout/vllm_stream.py says which
        ones a count takes) on the TP group's collect rank, None elsewhere; [] when no session is
        open (it may have finished while the call was queued)."""
        spans.relabel(self._stream_stage)
        if self._stream is None:
            return [] if self.rollout.is_collect else None
        with self._stream_timed():
            partials = self._stream_call(self._stream.export, None if count is None else int(count),
                                         bool(unstarted_only))
        if count is None and not unstarted_only:  # every sample left: the session is done
            self._close_stream()
        return partials if self.rollout.is_collect else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stream_adopt(self, partials: list, first: bool = False) -> int:
        """Go on with samples another rank exported, in this rank's session (opened, with no prompts
        of its own, when none is: also after this rank's own session ended). Every rank of the TP
        group takes the same list. ``first``: ahead of this rank's own waiting samples
        (``VLLMStream.adopt``). Returns how many."""
        spans.relabel(self._stream_stage)
        with self._stream_timed():
            if self._stream is None:
                self._open_stream()
            return self._stream_call(self._stream.adopt, list(partials or []), bool(first))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stream_metrics(self) -> dict:
        """The metrics of this rank's last closed session (an exporting rank's, which no step returns)."""
        return dict(self._stream_last_metrics)

    # ------------------------------------------------------------------ the session
    def _open_stream(self) -> None:
        from workers.rollout.vllm_stream import VLLMStream

        if getattr(self.rollout, "llm", None) is None:
            raise RuntimeError("streaming generation needs rollout.name=vllm")
        metrics: dict[str, float] = {}
        self._enter_generation(metrics)
        try:
            self._stream = VLLMStream(self.rollout)
        except BaseException:
            self._leave_generation()
            raise
        self._stream_metrics, self._stream_seconds = metrics, 0.0

    def _close_stream(self) -> dict:
        """Close the session, leave generation mode; returns the session's metrics."""
        stream, self._stream = self._stream, None
        metrics = dict(self._stream_metrics or {})
        try:
            metrics.update(stream.metrics())
            metrics["timing_s/gen_worker"] = self._stream_seconds
            stream.close()
        finally:
            self._leave_generation()
        self._stream_last_metrics = metrics
        return metrics

    def _stream_call(self, fn, *args):
        """A session call; a failure closes the session (aborting its requests) and leaves
        generation mode, so the worker is usable again."""
        try:
            return fn(*args)
        except BaseException:
            if self._stream is not None:
                self._close_stream()
            raise

    @contextmanager
    def _stream_timed(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._stream_seconds += time.perf_counter() - t0

    def _stream_rows(self, rows: DataProto) -> None:
        """Columns the host adds to a step's rows (none here)."""
