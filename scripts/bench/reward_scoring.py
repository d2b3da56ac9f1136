"""Benchmark what the reward time limit costs: scoring in a killable child process
(``custom_reward_function.timeout_s``, the default) against scoring in the caller's process
(``timeout_s=null``, no limit), on the same batches of the demo's arithmetic task.

The two managers score the same responses alternately (load drift hits both); the figure is
microseconds per sample, best of the rounds, and the child's start (once per run, and again after
each call cut at the limit).

    python scripts/bench/reward_scoring.py
    python scripts/bench/reward_scoring.py --batch 4096 --rounds 7

Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hybridflow.rewards import make_reward_manager  # noqa: E402


def batch_of(size: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """Arithmetic answers, half right: (responses, ground truths)."""
    rng = random.Random(seed)
    truths = [str(rng.randint(0, 198)) for _ in range(size)]
    responses = [t if rng.random() < 0.5 else str(int(t) + 1) for t in truths]
    return responses, truths


def score_s(manager, responses: list[str], truths: list[str]) -> float:
    started = time.perf_counter()
    manager(responses, [len(r) for r in responses], 16, ["arithmetic"] * len(responses), truths)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args()

    responses, truths = batch_of(args.batch)
    inline = make_reward_manager()
    bounded = make_reward_manager(timeout_s=args.timeout_s)
    started = time.perf_counter()
    score_s(bounded, responses[:1], truths[:1])  # starts the child
    child_start_s = time.perf_counter() - started
    times = {"inline": [], "child_process": []}
    for _ in range(args.rounds):
        times["inline"].append(score_s(inline, responses, truths))
        times["child_process"].append(score_s(bounded, responses, truths))
    bounded.close()
    per_sample_us = {mode: min(ts) / args.batch * 1e6 for mode, ts in times.items()}
    print(json.dumps({
        "batch": args.batch, "rounds": args.rounds, "timeout_s": args.timeout_s,
        "per_sample_us": {k: round(v, 2) for k, v in per_sample_us.items()},
        "extra_per_sample_us": round(per_sample_us["child_process"] - per_sample_us["inline"], 2),
        "child_over_inline": round(per_sample_us["child_process"] / per_sample_us["inline"], 2),
        "child_start_s": round(child_start_s, 3),
    }, indent=1))


if __name__ == "__main__":
    main()
