"""The run's stage timeline on the controller (``trainer.timeline``): the workers' stage spans,
taken once per step with one call per worker process, the driver's own stages from ``timer``,
``perf/idle_frac/<pool>`` per step, and at the end timeline.json and timeline.png in the run folder
(hybridflow/tracking/timeline.py writes them; controller/spans.py records).

Off, nothing records and no call is made. On, the driver keeps the spans of the last
``KEEP_STEPS`` steps (and what ran after them), so a long run's memory stays bounded.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager, nullcontext

from hybridflow.controller import spans
from hybridflow.tracking.timeline import DRIVER, idle_fractions, plot_gantt, write_chrome_trace

KEEP_STEPS = 100
# the last take, when the run ends or fails: a worker that hangs must not hold the run's exit
FINAL_TAKE_TIMEOUT_S = 30.0
# the driver's timers that only wait for a worker group's call (the workers' tracks show the work)
# or contain other stages; the others (reward, adv, ...) are the driver's own stages on its track
WAITS = frozenset({"step", "testing", "gen", "gen_max", "old_log_prob", "ref", "values", "update_critic",
                   "update_actor", "save_checkpoint"})


@contextmanager
def timer(name: str, metrics: dict):
    t0 = time.perf_counter()
    with nullcontext() if name in WAITS else spans.span(name):
        yield
    key = f"timing_s/{name}"  # summed: dynamic sampling generates and scores several batches a step
    metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - t0


class StageTimeline:
    """``groups``: role -> WorkerGroup (colocated roles' views share processes: one track each);
    each group's pool is the first part of its name (``main``, ``side``, ``reward``)."""

    def __init__(self, groups: dict, on: bool, keep_steps: int = KEEP_STEPS):
        self.on, self.keep_steps = on, keep_steps
        self._groups = list({id(g.actors[0]): g for g in groups.values()}.values()) if on else []
        self.tracks = [f"{g.name.split('/')[0]} rank {r}" for g in self._groups for r in range(g.world_size)]
        self.tracks.append(DRIVER)
        self.spans: dict[str, list] = {track: [] for track in self.tracks}
        self.steps: list[tuple[int, float, float]] = []
        if on:
            spans.enable()
            self._take()  # the workers' first take starts their recording

    def _take(self, timeout_s: float | None = None) -> None:
        for group in self._groups:
            pool = group.name.split("/")[0]
            for rank, got in enumerate(group.take_spans(timeout_s)):
                self.spans[f"{pool} rank {rank}"].extend(got)
        self.spans[DRIVER].extend(spans.take())

    @contextmanager
    def step(self, step: int, metrics: dict):
        """Around a training step: afterwards its spans are taken and its idle fractions logged."""
        if not self.on:
            yield
            return
        start = time.time()
        yield
        end = time.time()
        self._take()
        self.steps.append((step, start, end))
        metrics.update(idle_fractions(self.tracks, self.spans, start, end))
        if len(self.steps) > self.keep_steps:
            self.steps = self.steps[-self.keep_steps:]
            cut = self.steps[0][1]
            self.spans = {track: [sp for sp in got if sp[2] > cut] for track, got in self.spans.items()}

    def write(self, folder: str) -> tuple[str, str] | None:
        """timeline.json and timeline.png in ``folder``, also after a failure (when one wants them);
        never raises: a diagnostic must not lose the run's result."""
        if not self.on:
            return None
        self.on = False
        try:
            try:
                self._take(FINAL_TAKE_TIMEOUT_S)
            except Exception as err:  # a dead or hung worker: draw what was taken before
                print(f"timeline: the workers' last spans are missing ({type(err).__name__})", file=sys.stderr,
                      flush=True)
            spans.enable(False)
            paths = (write_chrome_trace(f"{folder}/timeline.json", self.tracks, self.spans, self.steps),
                     plot_gantt(f"{folder}/timeline.png", self.tracks, self.spans, self.steps))
        except Exception as err:
            print(f"timeline not written to {folder}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            return None
        print(f"stage timeline: {paths[0]} (open in ui.perfetto.dev), {paths[1]}", flush=True)
        return paths
