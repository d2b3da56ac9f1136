"""Stage fusion (RLHFuse, issue 34) on the long-tail workload: fused against unfused, one invocation.

Part ``stages`` (inter-stage fusion): PPO with a critic and a reference on the long-tail counting
workload (longtail.py's model, data and shape: 16 prompts x 8 samples, answers up to 256 tokens,
the default colocated layout on ``--workers`` CPU slots), two mini-batches per step so the actor's
old log-probs are computed too. Two runs of our recipe, the same but for ``stage_fusion.enable``:
``unfused`` (generate, then reward, old log-probs, reference, values) and ``fused`` (finished
samples scored and sent to inference as they complete, the long tail moved onto one rollout rank,
the freed rank computing log-probs and values meanwhile). Reports per run the medians after
``--warmup`` steps of the step and of every stage, and ``gen_and_inference_s``: generation +
reward + old log-probs + reference + values (the fused run's fused stage is timed as ``gen``, and
what it left is timed under its own name); then ``ratio_gen_and_inference`` (goal <= 0.75) and
``ratio_step`` (goal <= 0.85), fused over unfused.

Part ``update`` (intra-stage fusion): the actor's and the critic's Megatron pipeline-2 updates on
2 slots, fused against one after the other (``fusion_update.py``; goal <= 0.85, weights equal).

    .venv/bin/python scripts/bench/fusion.py                  # both parts, 8 min with assets cached
    .venv/bin/python scripts/bench/fusion.py --parts stages -- actor_rollout_ref.model.use_remove_padding=true
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
from longtail import add_workload_args, assets, checked_args, run_ours  # noqa: E402

INFERENCE = ("gen", "reward", "old_log_prob", "ref", "values")
FUSION_METRICS = ("fusion/gen_tail_share", "fusion/tail_rank_share", "fusion/migrated_samples", "fusion/rows_inferred_during_gen",
                  "fusion/gen_s", "fusion/inference_after_gen_s", "fusion/migrated_at_s", "perf/gen_tail_share")


def ppo_keys(args) -> tuple[str, ...]:
    """PPO (GAE with a critic) and a reference (KL loss) at the workload's shape; two mini-batches,
    so old log-probs are recomputed as PPO does past its first mini-batch. ``--greedy`` (the
    default): greedy decoding, one sample per prompt, ``prompts x samples`` prompts (the same rows),
    so both runs generate and train on the same tokens (sampled, the fused run draws other noise:
    one vLLM request per sample, and long-tailed lengths make a few steps' medians differ)."""
    prompts, samples = (args.prompts * args.samples, 1) if args.greedy else (args.prompts, args.samples)
    sampling = ("actor_rollout_ref.rollout.do_sample=false",) if args.greedy else ()
    return ("algorithm.adv_estimator=gae", "critic.enable=true", "actor_rollout_ref.actor.use_kl_loss=true",
            f"data.train_batch_size={prompts}", f"actor_rollout_ref.rollout.n={samples}", *sampling,
            f"actor_rollout_ref.actor.ppo_mini_batch_size={max(1, prompts // 2)}",
            f"critic.ppo_mini_batch_size={max(1, prompts // 2)}", f"critic.optim.lr={args.lr}")


def fused_keys(args) -> tuple[str, ...]:
    return ("stage_fusion.enable=true", f"stage_fusion.migrate_below={args.migrate_below}")


def run_stages(args, paths: dict) -> dict:
    results = {}
    for name, extra in (("unfused", ()), ("fused", fused_keys(args))):
        summary = run_ours(args, paths, name, (*ppo_keys(args), *extra, *args.overrides), keys=FUSION_METRICS)
        if "timing_s" in summary:
            summary["gen_and_inference_s"] = round(sum(summary["timing_s"].get(k, 0.0) for k in INFERENCE), 4)
        results[name] = summary
        print(f"[fusion] {name}: {summary.get('step_s', summary.get('error'))} s/step, gen+inference "
              f"{summary.get('gen_and_inference_s')} s", file=sys.stderr, flush=True)
    out = {"results": results}
    unfused, fused = results["unfused"], results["fused"]
    if fused.get("gen_and_inference_s") and unfused.get("gen_and_inference_s"):
        out["ratio_gen_and_inference"] = round(fused["gen_and_inference_s"] / unfused["gen_and_inference_s"], 3)
    if fused.get("step_s") and unfused.get("step_s"):
        out["ratio_step"] = round(fused["step_s"] / unfused["step_s"], 3)
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p, steps=5)
    p.add_argument("--parts", default="stages,update", help="comma list of: stages, update")
    p.add_argument("--sampled", dest="greedy", action="store_false",
                   help="sample (temperature 1, --samples per prompt) instead of greedy at equal work")
    p.add_argument("--migrate-below", type=float, default=0.25, help="stage_fusion.migrate_below of the fused run")
    p.add_argument("--update-args", default="", help="arguments for fusion_update.py's measure (one string)")
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "bench-fusion"))
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for both stage runs (after --)")
    return checked_args(p, argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start, load = time.perf_counter(), os.getloadavg()[0]
    parts = args.parts.split(",")
    report = {"setting": {"prompts": args.prompts, "samples": args.samples, "max_response_length": args.response_length,
                          "steps": args.steps, "warmup_steps_excluded": args.warmup, "workers": args.workers,
                          "migrate_below": args.migrate_below, "greedy": args.greedy, "overrides": args.overrides,
                          "cpus": os.cpu_count(), "load_avg_1m_at_start": load}}
    failed = False
    if "stages" in parts:
        paths = assets(args)
        report["setting"].update(model=paths["model"], data=paths["data"])
        report["stages"] = run_stages(args, paths)
        failed |= any("error" in r for r in report["stages"]["results"].values())
    if "update" in parts:
        from fusion_update import measure

        report["update"] = measure(args.update_args.split() if args.update_args else [])
        failed |= "error" in report["update"]
    report["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
