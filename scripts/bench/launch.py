"""What a short recipe run costs from launch to exit, and the host memory it holds, by KV cache size.

Runs the real recipe (``python -m recipes.main_ppo --config-name grpo``) on the demo-sized model
(the e2e bench's ``demo`` shape, 2 layers) for 2 steps with a validation before and after: a run
where start-up and shutdown are nearly all of the wall time, as in a smoke test or a first try.
The settings alternate run by run, ``--pairs`` times, so both see the same machine:

- ``auto``: ``rollout.kv_cache_gib`` left at its default (null: what ``max_num_seqs`` sequences
  of the whole context need, at most 1 GiB; workers/rollout/kv_cache_size.py);
- ``fixed_1gib``: ``rollout.kv_cache_gib=1.0``, the fixed size every engine got before.

vLLM on CPU zero-fills its whole KV cache at start-up and keeps it, so the difference is the page
faults of filling it and the resident memory it holds. Prints JSON: per setting the wall times,
the peak RSS of one Ray worker and of the host's used memory, and the medians' ratio.

    .venv/bin/python scripts/bench/launch.py                 # 5 pairs, about 6 minutes on 2 cores
    .venv/bin/python scripts/bench/launch.py --pairs 3 -- trainer.n_gpus_per_node=1
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

SETTINGS = {"auto": [], "fixed_1gib": ["actor_rollout_ref.rollout.kv_cache_gib=1.0"]}
BASE = ["trainer.n_gpus_per_node=2", "trainer.total_training_steps=2", "trainer.test_freq=2",
        "data.max_response_length=8", "trainer.logger=[jsonl]"]


def run_once(args, paths: dict, setting: str, index: int) -> dict:
    from memory import GB, Sampler, recipe_command

    run_dir = os.path.join(args.work_dir, "runs", f"{setting}-{index}")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd, env = recipe_command(paths["data"], paths["demo"], run_dir, [*BASE, *SETTINGS[setting], *args.overrides])
    start = time.perf_counter()
    with Sampler(interval_s=0.25) as sampler:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    shutil.rmtree(run_dir, ignore_errors=True)
    if proc.returncode:
        raise RuntimeError(f"{setting} run failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return dict(wall_s=round(wall, 2), peak_worker_rss_gb=round(sampler.peak_worker_rss / GB, 3),
                peak_host_used_gb=round(sampler.peak_used / GB, 3))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--work-dir", default=os.path.join(REPO, "data", "bench_launch"))
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for both settings (after --)")
    args = p.parse_args(argv)
    from e2e import build_assets

    paths = build_assets(args.work_dir, ["demo"])
    runs = {name: [] for name in SETTINGS}
    for i in range(args.pairs):
        order = list(SETTINGS) if i % 2 == 0 else list(reversed(SETTINGS))
        for name in order:
            runs[name].append(run_once(args, paths, name, i))
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "settings": {}}
    for name, rows in runs.items():
        out["settings"][name] = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        out["settings"][name]["wall_s_each"] = [r["wall_s"] for r in rows]
    auto, fixed = out["settings"]["auto"], out["settings"]["fixed_1gib"]
    out["wall_ratio_auto_to_fixed"] = round(auto["wall_s"] / fixed["wall_s"], 3)
    out["worker_rss_saved_gb"] = round(fixed["peak_worker_rss_gb"] - auto["peak_worker_rss_gb"], 3)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
