"""Time to accuracy (issue 32 item 3): wall time from launch until the greedy validation score
(``val/score/mean``) first reaches a target, ours against TRL's GRPOTrainer, in one invocation.

    .venv/bin/python scripts/bench/time_to_accuracy.py --tasks demo --max-minutes 8 --lock /tmp/hf_cpu.lock
    .venv/bin/python scripts/bench/time_to_accuracy.py --tasks demo,count --trl-our-batch

Tasks:
- ``demo``: the demo's GRPO run as ``make run`` does it (``recipes.demo.GRPO_OVERRIDES``: the
  SFT-warm-started tiny Qwen2, 64 prompts x 8, lr 5e-4, 8 response tokens, validation every 20
  steps), target 0.6 (the demo starts near 0.37 and ``make run`` passed 0.6 at step 220).
- ``count``: the long-tail counting workload (``workloads/count_model.py``: the ~25M Qwen2
  warm-started on it, 16 prompts x 8, lr 1e-5, up to 256 response tokens, grpo.yaml's defaults
  otherwise), validation every 5 steps (80 prompts). Target 0.58: the warm model's greedy start
  (0.487 here in ours, 0.491 in TRL's validation; a fifth of its greedy answers run to 256 tokens
  without stopping) plus about 0.1, which ours passed after 20 steps (2 min) on 2026-11-26; at
  0.52 (start + 0.03) both frameworks passed at their first validation, so that target compares
  only the cost of the first 80 prompts.

Ours: the recipe in a subprocess (``python -m recipes.main_ppo``) with validation before training
and every ``test_freq`` steps; this script polls its ``metrics.jsonl`` and sends SIGTERM (the
recipe stops cleanly on it) once a ``val/score/mean`` >= target appears, or at ``--max-minutes``.
TRL: ``trl_time_to_accuracy.py`` in a subprocess, TRL's own GRPOConfig defaults except the model,
training data and run length in prompts (``max_steps``: ours, 600 x 64 prompts on the demo,
where TRL's 3 epochs would end its run at our batch after 96 steps), learning rate, samples per
prompt, completion length, use_cpu and seed; it
validates greedily with our reward on the same validation set after the same number of training
prompts as ours (TRL's default step holds 1 prompt, ours 64 on the demo: every 20 of our steps is
every 1280 of TRL's), and stops itself. ``--trl-our-batch`` adds a TRL run with our prompts per
step, since TRL's defaults change the batch too.

Prints one JSON: per task the target and, per run, ``time_to_target_s`` (from launch, with
startup and validations), ``train_time_to_target_s`` (the optimizer steps only: our
``timing_s/step`` summed, TRL's step callbacks), steps, prompts consumed, the val curve
``[seconds, score]``, the best score when the target was not reached, and ours/TRL ratios (a bound
when only one side reached it). ``--lock PATH`` holds an flock on PATH during each run, so runs do
not share the CPU with other heavy jobs that take the same lock.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(BENCH))
sys.path[:0] = [REPO, BENCH]

from _trl_common import ensure_trl  # noqa: E402
from e2e import actor_dtype  # noqa: E402

COUNT_TEST_FREQ = 5
# The long-tail workload's GRPO run as longtail.py sets it (16 prompts x 8, prompts up to 24 and
# answers up to 256 tokens, no KL loss, lr 1e-5, one optimizer step per batch), grpo.yaml's
# defaults otherwise (its micro-batch sizes; param_dtype auto: bf16 on AVX512-BF16 CPUs)
COUNT_SETTINGS = [
    "data.max_prompt_length=24", "data.max_response_length=256", "data.train_batch_size=16",
    "data.apply_chat_template=false", "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.actor.optim.lr=1e-5", "trainer.n_gpus_per_node=2", "trainer.total_epochs=100",
    # the run's length (TRL's LR decays over it); --max-minutes stops both well before
    "trainer.total_training_steps=300",
]


def override(overrides: list[str], key: str, default: str | None = None) -> str | None:
    """The value the last ``key=value`` in ``overrides`` gives (Hydra's rule), else ``default``."""
    values = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").split("=", 1)[0] == key]
    return values[-1] if values else default


def first_file(value: str) -> str:
    """``[a.parquet]`` or ``a.parquet`` -> ``a.parquet`` (our tasks each have one file per split)."""
    return value.strip("[]").split(",")[0].strip()


def first_crossing(points: list[dict], target: float) -> dict | None:
    """The first validation point whose score reaches ``target``, in the order they were taken."""
    return next((p for p in points if p["score"] >= target), None)


def summarize(points: list[dict], target: float, wall_s: float, startup_s: float | None) -> dict:
    """A run's validation points -> the figures the table reads (see the module docstring)."""
    hit = first_crossing(points, target)
    best = max(points, key=lambda p: p["score"]) if points else None
    out = {"reached": hit is not None, "wall_s": round(wall_s, 1),
           "startup_s": None if startup_s is None else round(startup_s, 1),
           "curve": [[round(p["seconds"], 1), round(p["score"], 4)] for p in points]}
    if hit is not None:
        out.update(time_to_target_s=round(hit["seconds"], 1), train_time_to_target_s=round(hit["train_s"], 1),
                   steps=hit["step"], prompts=hit["prompts"], score=round(hit["score"], 4))
    elif best is not None:
        out.update(best_score=round(best["score"], 4), best_at_s=round(best["seconds"], 1),
                   steps=points[-1]["step"], prompts=points[-1]["prompts"])
    return out


def ratio(ours: dict, trl: dict) -> dict | None:
    """Ours over TRL's time to target; a bound when one side ran out of time (its wall time is
    then a lower bound on its time to target)."""
    if ours.get("error") or trl.get("error"):
        return None
    if ours["reached"] and trl["reached"]:
        return {"ratio": round(ours["time_to_target_s"] / trl["time_to_target_s"], 3),
                "train_ratio": round(ours["train_time_to_target_s"] / trl["train_time_to_target_s"], 3)}
    if ours["reached"]:
        return {"ratio_at_most": round(ours["time_to_target_s"] / trl["wall_s"], 3)}
    if trl["reached"]:
        return {"ratio_at_least": round(ours["wall_s"] / trl["time_to_target_s"], 3)}
    return None


@contextlib.contextmanager
def cpu_lock(path: str | None):
    """flock(2) on ``path`` (the same lock as the ``flock`` command) while a run is measured."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ------------------------------------------------------------------ tasks
def demo_task(args) -> dict:
    from recipes import demo

    if not os.path.exists(os.path.join(REPO, demo.SFT_MODEL, "config.json")):
        print("time_to_accuracy: building the demo's SFT model (recipes/demo.py's warm start)", file=sys.stderr)
        code = ("from recipes import demo, main_sft; demo.build_assets(); "
                "main_sft.run(main_sft.load_and_validate(demo.SFT_OVERRIDES))")
        subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
    return {"data_source": "arithmetic", "overrides": list(demo.GRPO_OVERRIDES), "target": args.target_demo,
            "test_freq": int(override(demo.GRPO_OVERRIDES, "trainer.test_freq"))}


def count_task(args) -> dict:
    from workloads.count_model import build_longtail_assets

    assets = build_longtail_assets(REPO)
    data, model = assets["data"], assets["model"]
    overrides = [f"data.train_files=[{data}/train.parquet]", f"data.val_files=[{data}/val.parquet]",
                 f"actor_rollout_ref.model.path={model}", *COUNT_SETTINGS]
    return {"data_source": "count", "overrides": overrides, "target": args.target_count,
            "test_freq": COUNT_TEST_FREQ}


TASKS = {"demo": demo_task, "count": count_task}


# ------------------------------------------------------------------ runs
def read_new_records(path: str, offset: int) -> tuple[list[dict], int]:
    """Complete lines appended to ``path`` since ``offset`` (the logger flushes whole lines)."""
    if not os.path.exists(path):
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1
    lines = chunk[:end].decode().splitlines()
    return [json.loads(line) for line in lines if line.strip()], offset + end


def stop(proc: subprocess.Popen, grace: float = 120.0) -> None:
    """SIGTERM (the recipe shuts its Ray workers down on it), then SIGKILL its group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_ours(name: str, task: dict, args) -> dict:
    run_dir = os.path.join(args.work_dir, name, "ours")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    cmd = [sys.executable, "-m", "recipes.main_ppo", "--config-name", "grpo", *task["overrides"],
           f"trainer.default_local_dir={run_dir}", f"trainer.test_freq={task['test_freq']}",
           "trainer.val_before_train=true", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
           "trainer.resume_mode=disable", "trainer.seed=0", "data.seed=0"]
    prompts_per_step = int(override(task["overrides"], "data.train_batch_size"))
    points, train_s, offset, first_step_at, last_step = [], 0.0, 0, None, 0
    with open(os.path.join(run_dir, "run.log"), "w") as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:
                done = proc.poll() is not None
                records, offset = read_new_records(metrics, offset)
                now = time.time() - t0
                for r in records:
                    last_step = max(last_step, r["step"])
                    train_s += r.get("timing_s/step", 0.0)  # the step alone: validation is timing_s/testing
                    if first_step_at is None and r["step"] >= 1:
                        first_step_at = now - r.get("timing_s/step", 0.0) - r.get("timing_s/testing", 0.0)
                    if "val/score/mean" in r:
                        points.append({"step": r["step"], "prompts": r["step"] * prompts_per_step, "seconds": now,
                                       "train_s": train_s, "score": r["val/score/mean"]})
                if first_crossing(points, task["target"]) or done or now > args.max_minutes * 60:
                    break
                time.sleep(0.2)
        finally:
            wall = time.time() - t0
            stop(proc)
    out = summarize(points, task["target"], wall, first_step_at)
    if not points:
        with open(os.path.join(run_dir, "run.log")) as f:
            out["error"] = f"no validation in {wall:.0f} s (exit {proc.returncode}): " + f.read()[-2000:]
    return {**out, "steps_run": last_step, "prompts_per_step": prompts_per_step, "test_freq": task["test_freq"],
            "command": " ".join(cmd)}


def run_trl(name: str, task: dict, args, our_batch: bool) -> dict:
    ov = task["overrides"]
    tag = "trl_our_batch" if our_batch else "trl_defaults"
    run_dir = os.path.join(args.work_dir, name, tag)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    prompts_per_step = int(override(ov, "data.train_batch_size"))
    out_file = os.path.join(run_dir, "val.jsonl")
    cmd = [sys.executable, os.path.join(BENCH, "trl_time_to_accuracy.py"),
           "--model", override(ov, "actor_rollout_ref.model.path"),
           "--train", first_file(override(ov, "data.train_files")), "--val", first_file(override(ov, "data.val_files")),
           "--data-source", task["data_source"], "--lr", override(ov, "actor_rollout_ref.actor.optim.lr", "1e-5"),
           "--num-generations", override(ov, "actor_rollout_ref.rollout.n"),
           "--max-completion-length", override(ov, "data.max_response_length"),
           "--val-every-prompts", str(task["test_freq"] * prompts_per_step), "--target", str(task["target"]),
           "--max-prompts", str(int(override(ov, "trainer.total_training_steps")) * prompts_per_step),
           "--max-seconds", str(args.max_minutes * 60), "--seed", "0", "--out", out_file,
           "--output-dir", os.path.join(run_dir, "trainer"), "--val-dtype", actor_dtype(ov),
           *(["--prompts-per-step", str(prompts_per_step)] if our_batch else [])]
    with open(os.path.join(run_dir, "run.log"), "w") as log:
        t0 = time.time()
        proc = subprocess.Popen([*cmd, "--launch-time", repr(t0)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:  # it stops itself at the target or the cap; the grace covers a last long step
            proc.wait(timeout=args.max_minutes * 60 + 300)
        except subprocess.TimeoutExpired:
            pass
        finally:
            wall = time.time() - t0
            stop(proc, grace=30)
    rows = []
    if os.path.exists(out_file):
        with open(out_file) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    done = next((r for r in rows if r.get("done")), {})
    points = [{"step": r["step"], "prompts": r["prompts"], "seconds": r["seconds"], "train_s": r["train_s"],
               "score": r["val_score"]} for r in rows if "val_score" in r]
    out = summarize(points, task["target"], wall, done.get("startup_s"))
    if not done:
        with open(os.path.join(run_dir, "run.log")) as f:
            out["error"] = f"TRL run ended without a summary (exit {proc.returncode}): " + f.read()[-2000:]
    if done:
        out["steps_run"] = done["steps"]
    keys = ("framework", "prompts_per_step", "val_every_steps", "bf16", "gradient_checkpointing", "loss_type", "beta",
            "lr_scheduler", "val_dtype")
    settings = {k: done[k] for k in keys if k in done}
    return {**out, **settings, "command": " ".join(cmd)}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="demo,count", help="comma list of: " + ", ".join(TASKS))
    p.add_argument("--target-demo", type=float, default=0.6)
    p.add_argument("--target-count", type=float, default=0.58,
                   help="the warm model's greedy start (0.487) + about 0.1")
    p.add_argument("--max-minutes", type=float, default=8.0, help="cap per run; then 'not reached' and its best")
    p.add_argument("--trl-our-batch", action="store_true", help="also run TRL with our prompts per step")
    p.add_argument("--skip", default="", help="comma list of runs to leave out: ours, trl_defaults, trl_our_batch")
    p.add_argument("--lock", default=None, help="flock this file during each run (e.g. /tmp/hf_cpu.lock)")
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "bench-tta"))
    args = p.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    unknown = set(args.tasks) - set(TASKS)
    if unknown:
        p.error(f"unknown task(s) {sorted(unknown)}: use {sorted(TASKS)}")
    args.skip = set(s for s in args.skip.split(",") if s)
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    ensure_trl()
    report = {"max_minutes": args.max_minutes}
    for name in args.tasks:
        task = TASKS[name](args)
        runs = {}
        plan = [("ours", lambda: run_ours(name, task, args)),
                ("trl_defaults", lambda: run_trl(name, task, args, our_batch=False))]
        if args.trl_our_batch:
            plan.append(("trl_our_batch", lambda: run_trl(name, task, args, our_batch=True)))
        for tag, run in plan:
            if tag in args.skip:
                continue
            with cpu_lock(args.lock):
                print(f"time_to_accuracy: {name}: {tag}", file=sys.stderr, flush=True)
                runs[tag] = run()
            print(f"time_to_accuracy: {name}: {tag}: " + json.dumps({k: v for k, v in runs[tag].items()
                                                                      if k not in ("curve", "command")}),
                  file=sys.stderr, flush=True)
        ratios = {f"ours_over_{tag}": ratio(runs["ours"], runs[tag])
                  for tag in runs if tag != "ours" and "ours" in runs}
        report[name] = {"target": task["target"], "test_freq": task["test_freq"], **runs, "ratios": ratios}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
