"""PPO step time with the critic (and reference) on a pool of their own: both pools at once vs one
stage after the other, on the same placement and work.

Runs the real recipe (``python -m recipes.main_ppo --config-name ppo``) with
``trainer.placement=separate`` twice in one invocation, ``trainer.overlap_separate_pools=true``
and ``false``, and prints JSON: median step time and stages after the warm-up steps, and the
ratio overlapped / sequential (the numbers the two runs train are the same; see
tests/recipes/test_main_ppo.py). ``--colocate-too`` adds the default placement on the same slot
count for context (a different layout: every role on every slot, one after the other).

    .venv/bin/python scripts/bench/placement.py                       # medium size, 1 + 1 slots
    .venv/bin/python scripts/bench/placement.py --size demo --colocate-too
    .venv/bin/python scripts/bench/placement.py -- actor_rollout_ref.actor.use_kl_loss=true

The critic's update and the actor's take similar time at one size, so on a machine with a core
per slot the overlapped step approaches the sequential one minus the shorter update.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e import REPO, build_assets, summarise  # noqa: E402  (the e2e bench's models, data and medians)


def overrides(args, paths: dict, run_dir: str) -> list[str]:
    model = paths[args.size]
    slots = args.main_slots
    return [
        f"data.train_files=[{paths['data']}/train.parquet]", f"data.val_files=[{paths['data']}/val.parquet]",
        f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}", f"trainer.default_local_dir={run_dir}",
        "data.max_prompt_length=16", f"data.max_response_length={args.response_length}",
        f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.rollout.n={args.samples}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.mini_batch or args.prompts}",
        f"critic.ppo_mini_batch_size={args.mini_batch or args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        f"critic.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        f"critic.forward_micro_batch_size_per_gpu={args.micro_batch}",
        f"trainer.n_gpus_per_node={slots}", f"trainer.total_training_steps={args.steps}",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
        "trainer.logger=[jsonl]", "trainer.resume_mode=disable", "trainer.experiment_name=bench-placement",
        *args.overrides,
    ]


def run(args, paths: dict, tag: str, extra: list[str]) -> dict:
    run_dir = os.path.join(args.work_dir, "runs", f"placement-{args.size}-{tag}")
    metrics_file = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics_file):
        os.remove(metrics_file)  # the jsonl logger appends
    cmd = [sys.executable, "-m", "recipes.main_ppo", "--config-name", "ppo", *overrides(args, paths, run_dir), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not os.path.exists(metrics_file):
        return {"error": f"recipe exited {proc.returncode}", "command": " ".join(cmd),
                "log_tail": (proc.stderr or proc.stdout)[-3000:]}
    with open(metrics_file) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {**summarise(records, args.warmup, args.prompts, args.samples), "wall_s": round(time.perf_counter() - t0, 1)}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="medium", choices=("demo", "medium"))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--response-length", type=int, default=16)
    p.add_argument("--mini-batch", type=int, default=0, help="prompts per optimizer step (0: all)")
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--main-slots", type=int, default=1, help="trainer.n_gpus_per_node (the actor's pool)")
    p.add_argument("--side-slots", type=int, default=1, help="trainer.separate_pool_gpus_per_node")
    p.add_argument("--colocate-too", action="store_true", help="also every role colocated on main+side slots")
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "bench-e2e"))
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for every run (after --)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    paths = build_assets(args.work_dir, [args.size])
    separate = ["trainer.placement=separate", f"trainer.separate_pool_gpus_per_node={args.side_slots}"]
    results = {
        "overlapped": run(args, paths, "overlapped", separate + ["trainer.overlap_separate_pools=true"]),
        "sequential": run(args, paths, "sequential", separate + ["trainer.overlap_separate_pools=false"]),
    }
    if args.colocate_too:
        results["colocated"] = run(args, paths, "colocated",
                                   [f"trainer.n_gpus_per_node={args.main_slots + args.side_slots}"])
    out = {"bench": "placement", "size": args.size, "main_slots": args.main_slots, "side_slots": args.side_slots,
           "load_avg_1m": round(os.getloadavg()[0], 2), "runs": results}
    steps = {k: v.get("step_s") for k, v in results.items()}
    if steps["overlapped"] and steps["sequential"]:
        out["overlapped_over_sequential"] = round(steps["overlapped"] / steps["sequential"], 3)
    print(json.dumps(out, indent=2))
    return 0 if all("error" not in v for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
