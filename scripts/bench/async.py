"""The rollout on its own pool, one step off policy, against the same pools taking turns and the
default colocated layout (issue 33's benchmark), on the long-tail counting workload.

Three runs of our GRPO recipe, each in its own process, at the workload's shape (longtail.py: the
warm-started e2e-medium model, 16 prompts x 8 samples, answers up to 256 tokens):

- ``one_step_off``: ``actor_rollout_ref.hybrid_engine=false``, one rollout slot and one trainer slot,
  ``async_training.staleness_threshold=1`` (the rollout samples batch k+1 while step k trains);
- ``turns``: the same two pools with ``staleness_threshold=0``: each waits for the other (the
  baseline the overlap is measured against: same devices, same work);

both as the ``grpo_async`` recipe has them: verl's bypass mode, pi_old the sampler's own log-probs;
- ``colocated``: the hybrid engine on both slots (our default layout).

    .venv/bin/python scripts/bench/async.py                    # about 10 min with the assets cached
    .venv/bin/python scripts/bench/async.py -- actor_rollout_ref.model.use_remove_padding=false

Prints one JSON: per run the median over the steps after ``--warmup`` of the step, its stages,
samples/s, staleness and idle fractions (``perf/idle_frac/<pool>``, from the stage timeline:
timeline.png shows both pools working at once); then ``speedup_one_step_off_over_turns`` (goal
>= 1.4) and ``speedup_one_step_off_over_colocated``. Overlap can at best hide the shorter of
generation and training, so the first ratio is bounded by 1 + min(gen, train) / max(gen, train)
of the ``turns`` run, printed as ``overlap_bound``. Packed sequences (``use_remove_padding=true``,
the default here) make training shorter on these long-tailed lengths, and the two stages closer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

from e2e import REPO  # noqa: E402
from longtail import add_workload_args, assets, checked_args, recipe_overrides, run_ours  # noqa: E402

# grpo_async's settings: verl's bypass mode (pi_old is the sampler's log-probs, no trainer forward)
TWO_POOLS = ("actor_rollout_ref.hybrid_engine=false", "trainer.n_gpus_per_node=1", "rollout.nnodes=1",
             "rollout.n_gpus_per_node=1", "algorithm.rollout_correction.bypass_mode=true")
RUNS = {
    "one_step_off": (*TWO_POOLS, "async_training.staleness_threshold=1"),
    "turns": (*TWO_POOLS, "async_training.staleness_threshold=0"),
    "colocated": (),  # longtail.py's layout: --workers slots
}
ASYNC_METRICS = ("async/staleness_mean", "async/staleness_max", "weight_sync/bytes")


# packed sequences: a user's ``--`` overrides and the workload's keys come after, and win
PACKED = ("actor_rollout_ref.model.use_remove_padding=true",)


def overrides(args, paths: dict) -> list[str]:
    """Every run's keys before its own (``RUNS``): longtail.py's GRPO at the workload's shape, packed."""
    return [*PACKED, *recipe_overrides(args, paths)]


def run(args, paths: dict, name: str) -> dict:
    summary = run_ours(args, paths, name, RUNS[name], leading=PACKED, keys=ASYNC_METRICS)
    if "step_s" in summary:
        summary["samples_per_s"] = round(args.prompts * args.samples / summary["step_s"], 2)
    return summary


def overlap_bound(turns: dict) -> float | None:
    """1 + min / max of the generation wait and the rest of the step in the turns run."""
    step, gen = turns.get("step_s"), turns.get("timing_s", {}).get("gen")
    if not step or not gen:
        return None
    rest = step - gen
    return round(1 + min(gen, rest) / max(gen, rest), 3)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p, steps=7)  # --workers: the colocated run's slots (the pools take one each)
    p.add_argument("--runs", default=",".join(RUNS), help="comma list of: " + ", ".join(RUNS))
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "bench-async"))
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for every run (after --)")
    return checked_args(p, argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start, load = time.perf_counter(), os.getloadavg()[0]
    paths = assets(args)
    results = {}
    for name in args.runs.split(","):
        results[name] = run(args, paths, name)
        print(f"[async] {name}: {results[name].get('step_s', results[name].get('error'))} s/step",
              file=sys.stderr, flush=True)
    report = {
        "setting": {"model": paths["model"], "data": paths["data"], "prompts": args.prompts,
                    "samples": args.samples, "max_response_length": args.response_length, "steps": args.steps,
                    "warmup_steps_excluded": args.warmup, "overrides": args.overrides, "cpus": os.cpu_count(),
                    "load_avg_1m_at_start": load},
        "results": results,
    }
    sps = {name: r.get("samples_per_s") for name, r in results.items()}
    if sps.get("one_step_off") and sps.get("turns"):
        report["speedup_one_step_off_over_turns"] = round(sps["one_step_off"] / sps["turns"], 3)
        report["overlap_bound"] = overlap_bound(results["turns"])
    if sps.get("one_step_off") and sps.get("colocated"):
        report["speedup_one_step_off_over_colocated"] = round(sps["one_step_off"] / sps["colocated"], 3)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=2))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
