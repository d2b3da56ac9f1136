"""GRPO on the long-tail counting workload, ours and TRL's GRPOTrainer side by side (issue 32 item 2).

Generation dominates here and answer lengths are long-tailed (the workload: docs/benchmarks.md,
"Long-tail workload"): the baseline the next issues (asynchronous rollout, stage fusion,
speculative rollout) cut. Each run is the real thing in its own process: our recipe
(``python -m recipes.main_ppo --config-name grpo``, the default layout on the
``trainer.n_gpus_per_node`` CPU slots, ``trainer.timeline=true``) and TRL's GRPOTrainer
(``trl_grpo_baseline.py --task count``, installed into this venv when missing). Both: the
warm-started model of ``workloads/count_model.py`` (built and cached under data/ on first use),
16 prompts x 8 samples per step, prompts up to 24 and answers up to 256 tokens, temperature 1,
top_p 1, beta 0 (no reference model: TRL's default), lr 1e-5, one optimizer step per batch.

    .venv/bin/python scripts/bench/longtail.py                     # assets, ours x2, TRL: < 15 min
    .venv/bin/python scripts/bench/longtail.py --both-dtypes       # + TRL in the other dtype
    .venv/bin/python scripts/bench/longtail.py --model M --data D  # another checkpoint / data folder

Runs: ``every_row`` (``actor.skip_zero_advantage=false``: every row computed, as TRL does; equal
work, the ratio's figure), ``default`` (our defaults: rows whose group advantage is 0 skip the
update), and ``trl`` at the precision ours resolved ``param_dtype=auto`` to (``--bf16`` when it
chose bf16, read from the run's stderr). Prints one JSON: per run the median over the steps after
``--warmup`` of the step and of every stage (``timing_s/*``), the share of the step generating,
tokens/s, the generated lengths' p50/p80/p95/max (the median over steps of each step's), the tail
share of generation (ours timed: ``perf/gen_tail_share``; TRL's estimated from lengths, see
trl_grpo_baseline.py), idle fractions and our timeline files; then ``ratio_step_ours_over_trl``
(equal work) and ``ratio_step_ours_default_over_trl``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

from e2e import REPO, actor_dtype, run_json_script, run_recipe, summarise  # noqa: E402

RUNS = {"every_row": ("actor_rollout_ref.actor.skip_zero_advantage=false",), "default": ()}
# what resolve_param_dtype says on stderr when it decides auto
AUTO_DTYPE_LINE = re.compile(r"param_dtype=auto -> (\w+)")


def assets(args) -> dict:
    """The model and data folder: the flags', else the workload's (built under data/ when missing)."""
    if args.model and args.data:
        return {"model": os.path.abspath(args.model), "data": os.path.abspath(args.data), "built": False}
    from workloads.count_model import build_longtail_assets

    built = build_longtail_assets(REPO)
    return {"model": os.path.abspath(args.model or built["model"]),
            "data": os.path.abspath(args.data or built["data"]), "built": built.get("built", False)}


def recipe_overrides(args, paths: dict) -> list[str]:
    """GRPO at the bench's shape; placement, FSDP layout and dtype stay the defaults."""
    # micro-batches: our defaults unless --micro-batch (each is cut to its own longest row, so on
    # long-tailed lengths small ones compute far less padding than one pass over a worker's rows)
    micro = [f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
             f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch}"] if args.micro_batch else []
    return [*micro,
        f"data.train_files=[{paths['data']}/train.parquet]", f"data.val_files=[{paths['data']}/val.parquet]",
        f"actor_rollout_ref.model.path={paths['model']}", "data.apply_chat_template=false",
        f"data.max_prompt_length={args.prompt_length}", f"data.max_response_length={args.response_length}",
        f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.rollout.n={args.samples}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",  # one optimizer step per batch
        "actor_rollout_ref.actor.use_kl_loss=false", f"actor_rollout_ref.actor.optim.lr={args.lr}",
        "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.top_p=1.0",
        f"trainer.n_gpus_per_node={args.workers}", f"trainer.total_training_steps={args.steps}",
        "trainer.timeline=true", "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
        "trainer.logger=[jsonl]", "trainer.resume_mode=disable", "trainer.experiment_name=bench-longtail",
        *args.overrides,
    ]


def resolved_dtype(stderr: str, overrides: list[str]) -> str:
    """The actor's dtype in our run: what the recipe said it resolved auto to, else the override /
    this process's own probe (e2e.actor_dtype)."""
    said = AUTO_DTYPE_LINE.findall(stderr or "")
    return said[-1] if said else actor_dtype(overrides)


def run_ours(args, paths: dict, name: str, overrides: tuple = None, leading: tuple = (), keys: tuple = ()) -> dict:
    """Our recipe at the workload's shape with ``overrides`` (default: ``RUNS[name]``) after it and
    ``leading`` before it (the shape's keys and a user's win over those); ``keys``: metrics whose
    median after the warm-up steps is reported too (``a/b`` as ``a_b``)."""
    run_dir = os.path.join(args.work_dir, "runs", name)
    run = run_recipe([*leading, *recipe_overrides(args, paths), *(RUNS[name] if overrides is None else overrides)],
                     run_dir, args.timeout)
    if "error" in run:
        return run
    records = run["records"]
    steps_total = sum(r.get("timing_s/step", 0.0) for r in records)
    medians = {}
    for key in keys:
        values = sorted(r[key] for r in records[args.warmup:] if key in r)
        if values:
            medians[key.replace("/", "_")] = values[len(values) // 2]
    return {**summarise(records, args.warmup, args.prompts, args.samples), **medians,
            "param_dtype": resolved_dtype(run["stderr"], args.overrides),
            "timeline_json": os.path.join(run_dir, "timeline.json"),
            "timeline_png": os.path.join(run_dir, "timeline.png"),
            "wall_s": round(run["wall_s"], 1), "startup_and_teardown_s": round(run["wall_s"] - steps_total, 1)}


def run_trl(args, paths: dict, bf16: bool) -> dict:
    cmd = [sys.executable, os.path.join(BENCH, "trl_grpo_baseline.py"), "--task", "count",
           "--model", paths["model"], "--data", os.path.join(paths["data"], "train.parquet"), "--beta", "0",
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--prompts", str(args.prompts),
           "--samples", str(args.samples), "--max-completion-length", str(args.response_length),
           "--lr", str(args.lr), "--output-dir", os.path.join(args.work_dir, "trl", "bf16" if bf16 else "fp32"),
           *(["--bf16"] if bf16 else [])]
    out = run_json_script(cmd, args.timeout)
    out.pop("per_step", None)  # each step's figures: in the script's own output when run by hand
    return out


def ratios(results: dict, trl_key: str) -> dict:
    trl = results.get(trl_key, {}).get("step_s")
    out = {}
    for name, key in (("every_row", "ratio_step_ours_over_trl"), ("default", "ratio_step_ours_default_over_trl")):
        ours = results.get(name, {}).get("step_s")
        if ours and trl:
            out[key] = round(ours / trl, 3)
    return out


def add_workload_args(p: argparse.ArgumentParser, steps: int = 6) -> None:
    """The workload's flags, shared with the benches that run our recipe on it (async.py)."""
    p.add_argument("--model", default=None, help="an HF checkpoint (default: the workload's warm-started model)")
    p.add_argument("--data", default=None, help="a folder with train.parquet/val.parquet (default: the workload's)")
    p.add_argument("--steps", type=int, default=steps, help="GRPO steps per run (the first --warmup are left out)")
    p.add_argument("--warmup", type=int, default=2, help="leading steps left out of the medians")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-length", type=int, default=24)
    p.add_argument("--response-length", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--workers", type=int, default=2, help="trainer.n_gpus_per_node (CPU worker slots)")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="sequences per forward/backward per worker (0: our defaults, 4 per update and 8 per log-prob pass)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run before giving up")


def checked_args(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup} to leave steps to measure")
    args.work_dir = os.path.abspath(args.work_dir)
    return args


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--both-dtypes", action="store_true", help="also run TRL in the dtype ours did not resolve to")
    p.add_argument("--no-trl", action="store_true", help="ours only")
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "bench-longtail"))
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for our runs (after --)")
    return checked_args(p, argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    load = os.getloadavg()[0]
    paths = assets(args)
    assets_s = time.perf_counter() - start
    if not args.no_trl:
        from _trl_common import ensure_trl

        ensure_trl()
    results = {}
    for name in RUNS:
        results[name] = run_ours(args, paths, name)
        print(f"[longtail] ours {name}: {results[name].get('step_s', results[name].get('error'))} s/step",
              file=sys.stderr, flush=True)
    dtype = results["every_row"].get("param_dtype") or actor_dtype(args.overrides)
    if not args.no_trl:
        for bf16 in ([dtype == "bf16", dtype != "bf16"] if args.both_dtypes else [dtype == "bf16"]):
            key = "trl" if bf16 == (dtype == "bf16") else f"trl_{'bf16' if bf16 else 'fp32'}"
            results[key] = run_trl(args, paths, bf16)
            print(f"[longtail] {key}: {results[key].get('step_s', results[key].get('error'))} s/step",
                  file=sys.stderr, flush=True)
    report = {
        "setting": {"model": paths["model"], "data": paths["data"], "prompts": args.prompts, "samples": args.samples,
                    "max_prompt_length": args.prompt_length, "max_response_length": args.response_length,
                    "steps": args.steps, "warmup_steps_excluded": args.warmup, "workers": args.workers,
                    "lr": args.lr, "beta": 0.0, "param_dtype": dtype, "overrides": args.overrides,
                    "cpus": os.cpu_count(), "load_avg_1m_at_start": load},
        "results": results, **ratios(results, "trl"),
        "assets_s": round(assets_s, 1), "assets_built": paths["built"],
        "wall_s": round(time.perf_counter() - start, 1), "load_avg_1m_at_end": os.getloadavg()[0],
    }
    print(json.dumps(report, indent=2))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
