"""Reward and response-length curves from a run's metrics.jsonl, drawn to a PNG.

Draws on a bare `Figure` with the Agg canvas instead of `pyplot`, so it never changes the
process-wide matplotlib backend and works with no display.
"""
from __future__ import annotations

import json
import os

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

TRAIN_SCORE = "critic/score/mean"
VAL_SCORE = "val/score/mean"
RESPONSE_LENGTH = "response_length/mean"


def read_metrics(path: str) -> list[dict]:
    """Records of metrics.jsonl sorted by step; if a step appears twice (a resumed run logged
    it again) the later record wins."""
    by_step: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no} is not JSON ({e}); "
                                 "is this a metrics.jsonl written by the jsonl logger?") from e
            if "step" not in record:
                raise ValueError(f"{path}:{line_no} has no 'step' key; "
                                 "is this a metrics.jsonl written by the jsonl logger?")
            by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_metrics(metrics_path: str, out_path: str | None = None) -> str:
    """Write the curves PNG (default: metrics.png next to the jsonl) and return its path."""
    records = read_metrics(metrics_path)
    if out_path is None:
        out_path = os.path.join(os.path.dirname(os.path.abspath(metrics_path)), "metrics.png")
    curves = {key: _series(records, key) for key in (TRAIN_SCORE, VAL_SCORE, RESPONSE_LENGTH)}
    if not any(steps for steps, _ in curves.values()):
        raise ValueError(f"{metrics_path} has none of {list(curves)}; nothing to plot")

    fig = Figure(figsize=(11, 4), dpi=100)
    FigureCanvasAgg(fig)
    reward_ax, length_ax = fig.subplots(1, 2)
    steps, values = curves[TRAIN_SCORE]
    if steps:
        reward_ax.plot(steps, values, label=f"train ({TRAIN_SCORE})", color="tab:blue")
    steps, values = curves[VAL_SCORE]
    if steps:  # validation runs every test_freq steps: markers, so sparse points stay visible
        reward_ax.plot(steps, values, "o-", label=f"test ({VAL_SCORE})", color="tab:orange")
    reward_ax.set(title="reward", xlabel="step", ylabel="score")
    if reward_ax.lines:
        reward_ax.legend()
    steps, values = curves[RESPONSE_LENGTH]
    if steps:
        length_ax.plot(steps, values, color="tab:green")
    length_ax.set(title="response length", xlabel="step", ylabel=RESPONSE_LENGTH)
    for ax in (reward_ax, length_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path)
    return out_path
