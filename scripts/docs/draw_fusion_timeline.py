"""Draw docs/images/timeline_fusion.png: one step's generation and inference stages, unfused above,
fused below, from the timeline.json files of scripts/bench/fusion.py's two runs (same step, same
scale). ``python scripts/docs/draw_fusion_timeline.py [bench work dir] [step]``."""
from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import colormaps  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHOWN = ("gen", "generate_sequences", "weight_sync", "compute_log_prob", "compute_ref_log_prob", "compute_values",
         "compute_log_prob_local", "compute_ref_log_prob_local", "compute_values_local")


def window(path: str, step: int) -> tuple[dict[str, list], float]:
    """Each rank track's spans of ``SHOWN`` stages in step ``step``, from the step's start (seconds)."""
    trace = json.load(open(path))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    start = next(e["ts"] for e in events if e.get("ph") == "X" and e["name"] == f"step {step}")
    # the stages before the step's first update
    stop = min(e["ts"] for e in events if e.get("ph") == "X" and e["name"].startswith("update_") and e["ts"] > start)
    tracks: dict[str, list] = {}
    for e in events:
        track = names.get((e.get("pid"), e.get("tid")), "")
        if e.get("ph") == "X" and "rank" in track and e["name"] in SHOWN and start <= e["ts"] < stop:
            name = "gen" if e["name"] == "generate_sequences" else e["name"]
            tracks.setdefault(track, []).append((name, (e["ts"] - start) / 1e6, e["dur"] / 1e6))
    end = max(s + d for spans in tracks.values() for _, s, d in spans)
    return tracks, end


def main(work_dir: str, step: int) -> str:
    runs = {name: window(os.path.join(work_dir, "runs", name, "timeline.json"), step) for name in ("unfused", "fused")}
    horizon = max(end for _, end in runs.values())
    colours = dict(zip(SHOWN, colormaps["tab20"].colors))
    fig, axes = plt.subplots(2, 1, figsize=(11, 3.6), sharex=True)
    for ax, (name, (tracks, end)) in zip(axes, runs.items()):
        for row, track in enumerate(sorted(tracks)):
            for stage, s, d in tracks[track]:
                ax.broken_barh([(s, d)], (row - 0.4, 0.8), color=colours[stage])
        ax.set_yticks(range(len(tracks)), sorted(tracks))
        ax.set_title(f"{name}: generation and inference of step {step}, {end:.1f} s", fontsize=9, loc="left")
        ax.set_xlim(0, horizon * 1.02)
    axes[-1].set_xlabel("seconds from the step's start")
    used = [s for s in SHOWN if any(stage == s for tracks, _ in runs.values() for spans in tracks.values()
                                    for stage, _, _ in spans)]
    fig.legend(handles=[Patch(color=colours[s], label=s) for s in used], loc="center right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    out = os.path.join(REPO, "docs", "images", "timeline_fusion.png")
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "runs", "bench-fusion"),
               int(sys.argv[2]) if len(sys.argv) > 2 else 4))
