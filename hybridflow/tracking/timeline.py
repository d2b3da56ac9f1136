"""A run's stage timeline: the workers' and the driver's stage spans as a Chrome trace and a Gantt PNG.

Input: ``tracks``, the ordered track names (``"main rank 0"``, ..., ``"driver"``), each of a pool
(the word before `` rank``; the driver's track is its own pool); ``spans``, track -> [(stage,
start, end)] in time.time() seconds, disjoint within a track (controller/spans.py); ``steps``,
[(step, start, end)]. The trace (``timeline.json``) opens in https://ui.perfetto.dev or
chrome://tracing: one process per pool, one thread per track, one "X" event per span, the steps on
a track of their own under the driver. The PNG draws the last few steps, one row per track.
"""
from __future__ import annotations

import json
import os

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

DRIVER = "driver"
STEPS_TRACK = "steps"
GANTT_STEPS = 3  # the PNG's window: enough to see a step's shape and its neighbours


def pool_of(track: str) -> str:
    return track.split(" rank ")[0]


def idle_fractions(tracks: list[str], spans: dict, start: float, end: float) -> dict[str, float]:
    """``perf/idle_frac/<pool>``: per worker pool, the share of [start, end] its workers spent in no
    recorded stage, averaged over the pool's workers (the driver's track is not a pool)."""
    wall = end - start
    if wall <= 0:
        return {}
    per_pool: dict[str, list[float]] = {}
    for track in tracks:
        if track == DRIVER:
            continue
        busy = _covered([(max(s, start), min(e, end)) for _, s, e in spans.get(track, ()) if e > start and s < end])
        per_pool.setdefault(pool_of(track), []).append(1.0 - min(busy / wall, 1.0))
    return {f"perf/idle_frac/{pool}": sum(v) / len(v) for pool, v in per_pool.items()}


def _covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union (robust to overlaps, which the recorder does not produce)."""
    total, reach = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > reach:
            total += e - max(s, reach)
            reach = e
    return total


def chrome_trace(tracks: list[str], spans: dict, steps: list) -> dict:
    """The Chrome trace event format's JSON object ("X" complete events, times in microseconds from
    the first span; ``otherData.origin_unix_s`` is that moment)."""
    starts = [s for track in tracks for _, s, _ in spans.get(track, ())] + [s for _, s, _ in steps]
    origin = min(starts, default=0.0)
    pools = list(dict.fromkeys(pool_of(t) for t in tracks))
    events = []
    for pid, pool in enumerate(pools):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": pool}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})

    def track_events(track: str, tid: int, items) -> None:
        pid = pools.index(pool_of(track)) if track != STEPS_TRACK else pools.index(DRIVER)
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track}})
        for name, s, e in items:
            events.append({"ph": "X", "name": str(name), "cat": "stage", "pid": pid, "tid": tid,
                           "ts": round((s - origin) * 1e6, 1), "dur": round((e - s) * 1e6, 1)})

    for tid, track in enumerate(tracks):
        track_events(track, tid, spans.get(track, ()))
    if DRIVER in pools:
        track_events(STEPS_TRACK, len(tracks), [(f"step {n}", s, e) for n, s, e in steps])
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock": "time.time()", "origin_unix_s": origin}}


def write_chrome_trace(path: str, tracks: list[str], spans: dict, steps: list) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(tracks, spans, steps), f)
    return path


def plot_gantt(path: str, tracks: list[str], spans: dict, steps: list, last: int = GANTT_STEPS) -> str:
    """One row per track, a bar per span coloured by stage, over the last ``last`` steps (and what
    followed them: the final validation); without steps, everything recorded."""
    shown = steps[-last:]
    every = [sp for track in tracks for sp in spans.get(track, ())]
    lo = shown[0][1] if shown else min((s for _, s, _ in every), default=0.0)
    hi = max([e for _, _, e in every] + [e for _, _, e in shown], default=lo + 1.0)
    stages = list(dict.fromkeys(name for name, s, e in every if e > lo))
    tab20 = colormaps["tab20"].colors  # 10 strong colours, then their light twins: 20 distinct
    palette = list(tab20[0::2]) + list(tab20[1::2])
    colour = {name: palette[i % len(palette)] for i, name in enumerate(stages)}

    fig = Figure(figsize=(12, 1.2 + 0.45 * len(tracks)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for row, track in enumerate(tracks):
        for name, s, e in spans.get(track, ()):
            if e > lo:
                ax.broken_barh([(max(s, lo) - lo, e - max(s, lo))], (row - 0.4, 0.8), color=colour[name])
    for n, s, _ in shown:  # where each step starts
        ax.axvline(s - lo, color="grey", lw=0.8, ls="--")
        ax.text(s - lo, -0.7, f"step {n}", fontsize=8, color="grey", va="bottom")
    ax.set_yticks(range(len(tracks)), tracks)
    ax.set_ylim(len(tracks) - 0.5, -0.9)  # the first track on top
    ax.set_xlim(0, hi - lo)
    ax.set_xlabel("seconds")
    ax.set_title("stage timeline" + (f" (steps {shown[0][0]}-{shown[-1][0]})" if shown else ""))
    ax.grid(axis="x", alpha=0.3)
    if stages:
        ax.legend(handles=[Patch(color=colour[name], label=name) for name in stages], loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    return path
