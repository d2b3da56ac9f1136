"""End-to-end GRPO step time by stage, at the demo size and a "medium" size, optionally against TRL.

Runs the real recipe (``python -m recipes.main_ppo --config-name grpo``) once per model size and
per KL setting, each in its own process (a fresh Ray), on the seeded arithmetic task: 32 prompts
x 4 samples per step, responses up to 16 tokens. It reads the run's ``metrics.jsonl`` and prints
JSON: the median over the steps after the first ``--warmup`` (default 2: the first steps pay
one-off costs, vLLM graph warm-up, allocator growth, the first weight sync, and the second was
still 3-10x slower in its forward) of every ``timing_s/*`` stage, plus tokens/s.

    .venv/bin/python scripts/bench/e2e.py                          # demo + medium, beta 0 and KL
    .venv/bin/python scripts/bench/e2e.py --trl-python             # + TRL ratio (TRL installed here if missing)
    .venv/bin/python scripts/bench/e2e.py --sizes medium --modes kl -- actor_rollout_ref.actor.param_dtype=fp32
    .venv/bin/python scripts/bench/e2e.py --no-skip-too ...        # beta0 also with every row computed
    .venv/bin/python scripts/bench/e2e.py --both-dtypes ...        # fp32 and bf16, ours and TRL's
    .venv/bin/python scripts/bench/e2e.py --micro-batch 8 --dynamic-bsz-too 1536  # token-budget micro-batches
    .venv/bin/python scripts/bench/e2e.py --no-share-too ...       # also with every prompt forwarded per row
    .venv/bin/python scripts/bench/e2e.py --shm-too ...            # also with HYBRIDFLOW_SHM_COLLECTIVES=1
    .venv/bin/python scripts/bench/e2e.py --reward-ms 20 --async-reward-too  # a slow grader, inline vs async
    .venv/bin/python scripts/bench/e2e.py --sizes medium --best-precision --workers auto --trl-python --repeat 2
                                                                   # ours / TRL at equal work, best dtype and
                                                                   # attention each (--attention sdpa,eager)

With ``--trl-python`` the TRL GRPOTrainer baseline (``trl_grpo_baseline.py``) runs on the same
model, data and settings in the same invocation, in a process of its own: with no value in this
venv (TRL is installed into it when missing, ``_trl_common.ensure_trl``), or in the python given,
and ``ratio_to_trl`` is our median step time over TRL's (the goal in issue 6 is <= 0.5). Without it, TRL's figures quoted in issue 6 are
printed, labelled as not measured here. Everything else (model/data files, run folders) goes
under ``--work-dir``; models and data are built once and reused.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The demo's model (recipes/demo.py MODEL) and the medium one of issue 6 (about 25M parameters).
SIZES = {
    "demo": dict(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, tied=True),
    "medium": dict(hidden=512, intermediate=1536, layers=8, heads=8, kv_heads=4, tied=True),
}
MODES = {"beta0": False, "kl": True}  # actor_rollout_ref.actor.use_kl_loss
# Issue 6, "Benchmark and the speed to reach": TRL 1.16 GRPOTrainer, medium size, this machine kind.
TRL_QUOTED = {"beta0": {"step_s": 4.3, "gen_s": 1.2, "train_s": 3.1}, "kl": {"step_s": 5.3}}
LENGTH_STATS = ("p50", "p80", "p95", "max", "mean", "clip_ratio")  # response_length/* the summary keeps
STAGE_ORDER = ("gen", "reshard", "gen_worker", "reward", "old_log_prob", "ref", "adv", "update_actor",
               "update_actor_worker", "step")


def build_assets(work_dir: str, sizes: list[str]) -> dict[str, str]:
    """Arithmetic parquet files and one seeded checkpoint per size (skipped when already there)."""
    sys.path.insert(0, REPO)
    from hybridflow.data import ArithmeticTaskConfig, write_arithmetic_parquet
    from hybridflow.tiny import make_tiny_checkpoint

    data_dir = os.path.join(work_dir, "data")
    if not os.path.exists(os.path.join(data_dir, "val.parquet")):
        write_arithmetic_parquet(data_dir, ArithmeticTaskConfig(digits=2, operators="+", train_size=2048,
                                                                val_size=64, seed=0))
    paths = {"data": data_dir}
    for size in sizes:
        path = os.path.join(work_dir, "models", f"qwen2-{size}")
        if not os.path.exists(os.path.join(path, "config.json")):
            make_tiny_checkpoint(path, "qwen2", seed=0, **SIZES[size])
        paths[size] = path
    return paths


# A grader that takes ``ms`` per response (a service call when asleep, local work when busy),
# then scores as the built-in arithmetic scorer does.
SLOW_REWARD = '''import time

from hybridflow.rewards.registry import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None, ms=0.0, busy=False):
    end = time.perf_counter() + ms / 1000
    if busy:
        while time.perf_counter() < end:
            pass
    else:
        time.sleep(ms / 1000)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
'''


def reward_overrides(args) -> list[str]:
    if not args.reward_ms:
        return []
    path = os.path.join(args.work_dir, "slow_reward.py")
    with open(path, "w") as f:
        f.write(SLOW_REWARD)
    return [f"custom_reward_function.path={path}", f"+custom_reward_function.reward_kwargs.ms={args.reward_ms}",
            f"+custom_reward_function.reward_kwargs.busy={str(args.reward_busy).lower()}"]


def recipe_overrides(args, model_path: str, data_dir: str, use_kl: bool) -> list[str]:
    return [*args.reward_overrides,
        f"data.train_files=[{data_dir}/train.parquet]", f"data.val_files=[{data_dir}/val.parquet]",
        f"actor_rollout_ref.model.path={model_path}",
        "data.max_prompt_length=16", f"data.max_response_length={args.response_length}",
        f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.rollout.n={args.samples}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.mini_batch or args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.actor.use_kl_loss={str(use_kl).lower()}",
        f"actor_rollout_ref.rollout.name={args.rollout}",
        f"trainer.n_gpus_per_node={args.workers}", f"trainer.total_training_steps={args.steps}",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
        "trainer.logger=[jsonl]", "trainer.resume_mode=disable", "trainer.experiment_name=bench-e2e",
        *args.overrides,
    ]


def median_after_warmup(records: list[dict], warmup: int) -> tuple[dict[str, float], int]:
    """Median of every numeric timing/perf metric over the steps after ``warmup``."""
    steps = [r for r in records if r.get("step", 0) > warmup] or records
    keys = sorted({k for r in steps for k in r if k.startswith(("timing_s/", "perf/", "response_length/",
                                                                "critic/score/mean", "actor/skipped_rows_frac"))})
    out = {}
    for k in keys:
        vals = [r[k] for r in steps if isinstance(r.get(k), (int, float))]
        if vals:
            out[k] = statistics.median(vals)
    return out, len(steps)


def summarise(records: list[dict], warmup: int, prompts: int, samples: int) -> dict:
    med, n = median_after_warmup(records, warmup)
    stages = {k.split("/", 1)[1]: round(v, 4) for k, v in med.items() if k.startswith("timing_s/")}
    stages = dict(sorted(stages.items(), key=lambda kv: (STAGE_ORDER.index(kv[0]) if kv[0] in STAGE_ORDER
                                                         else len(STAGE_ORDER), kv[0])))
    step = med.get("timing_s/step", float("nan"))
    resp_tokens = med.get("response_length/mean", float("nan")) * prompts * samples
    return {
        "steps_measured": n,
        "step_s": round(step, 4),
        "timing_s": stages,
        "train_s": round(sum(stages.get(k, 0.0) for k in ("old_log_prob", "ref", "update_actor")), 4),
        "tokens_per_s": round(med.get("perf/total_num_tokens", float("nan")) / step, 1),
        "gen_response_tokens_per_s": round(resp_tokens / stages["gen"], 1) if stages.get("gen") else None,
        "response_length_mean": round(med.get("response_length/mean", float("nan")), 2),
        # the median over steps of each step's percentile (tokens, EOS included)
        "response_length": {k.split("/", 1)[1]: round(v, 1) for k, v in med.items()
                            if k.startswith("response_length/") and k.split("/", 1)[1] in LENGTH_STATS},
        "gen_share": round(stages["gen"] / step, 3) if stages.get("gen") else None,
        "gen_tail_share": round(med["perf/gen_tail_share"], 3) if "perf/gen_tail_share" in med else None,
        "idle_frac": {k.split("/", 2)[2]: round(v, 3) for k, v in med.items() if k.startswith("perf/idle_frac/")},
        "score_mean": round(med.get("critic/score/mean", float("nan")), 4),
        # rows left out of the update because their advantage is 0 (actor.skip_zero_advantage)
        "skipped_rows_frac": round(med["actor/skipped_rows_frac"], 3) if "actor/skipped_rows_frac" in med else None,
    }


def run_recipe(overrides: list[str], run_dir: str, timeout: int, env: dict | None = None,
               config_name: str = "grpo") -> dict:
    """One recipe run in a fresh process (its own Ray): {"records": metrics.jsonl's lines, "wall_s",
    "stderr"}, or {"error", "command", "log_tail"} when it fails. ``run_dir`` is its default_local_dir."""
    metrics_file = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics_file):
        os.remove(metrics_file)  # the jsonl logger appends; a stale file would mix runs
    cmd = [sys.executable, "-m", "recipes.main_ppo", "--config-name", config_name,
           f"trainer.default_local_dir={run_dir}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not os.path.exists(metrics_file):
        tail = (proc.stderr or proc.stdout)[-3000:]
        return {"error": f"recipe exited {proc.returncode}", "command": " ".join(cmd), "log_tail": tail}
    with open(metrics_file) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {"records": records, "wall_s": wall, "stderr": proc.stderr}


def run_ours(args, paths: dict, size: str, mode: str, extra: tuple[str, ...] = (), tag: str = "",
             env: dict | None = None) -> dict:
    run_dir = os.path.join(args.work_dir, "runs", f"{size}-{mode}{tag}")
    run = run_recipe([*recipe_overrides(args, paths[size], paths["data"], MODES[mode]), *extra],
                     run_dir, args.timeout, env)
    if "error" in run:
        return run
    steps_total = sum(r.get("timing_s/step", 0.0) for r in run["records"])
    said = [ln for ln in run["stderr"].splitlines() if ln.startswith(("n_gpus_per_node=auto", "param_dtype=auto",
                                                                      "fsdp_size=auto"))]
    return {**summarise(run["records"], args.warmup, args.prompts, args.samples), "wall_s": round(run["wall_s"], 1),
            "auto_choices": said,
            "startup_and_teardown_s": round(run["wall_s"] - steps_total, 1)}


def run_trl(args, paths: dict, size: str, mode: str, extra: tuple[str, ...] = ()) -> dict:
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trl_grpo_baseline.py")
    cmd = [args.trl_python, script, "--model", paths[size], "--data", os.path.join(paths["data"], "train.parquet"),
           "--beta", str(args.trl_beta if MODES[mode] else 0.0), "--steps", str(args.steps),
           "--prompts", str(args.prompts), "--samples", str(args.samples),
           "--max-completion-length", str(args.response_length), "--warmup", str(args.warmup),
           "--threads", str(args.trl_threads), "--output-dir", os.path.join(args.work_dir, "trl", f"{size}-{mode}"),
           *shlex.split(args.trl_args), *extra]
    return run_json_script(cmd, args.timeout)


def run_json_script(cmd: list[str], timeout: int) -> dict:
    """Run a bench script that prints its result as a JSON line last: that dict plus its wall time."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"{os.path.basename(cmd[1])} exited {proc.returncode}",
                "log_tail": (proc.stderr or proc.stdout)[-3000:]}
    return {**json.loads(lines[-1]), "wall_s": round(wall, 1)}


def actor_dtype(overrides: list[str]) -> str:
    """The actor's dtype in our runs: an override's, else what param_dtype=auto picks here (CPU)."""
    key = "actor_rollout_ref.actor.param_dtype="
    given = [o.split("=", 1)[1] for o in overrides if o.startswith(key)]
    if given and given[-1] != "auto":
        return given[-1]
    sys.path.insert(0, REPO)
    from hybridflow.device import auto_param_dtype

    dtype, why = auto_param_dtype(on_gpu=False)
    print(f"[e2e] param_dtype=auto -> {dtype} here: {why}", file=sys.stderr, flush=True)
    return dtype


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="demo,medium", help="comma list of: " + ", ".join(SIZES))
    p.add_argument("--modes", default="beta0,kl", help="comma list of: beta0 (no reference), kl (KL loss)")
    p.add_argument("--steps", type=int, default=6, help="GRPO steps per run (the first --warmup are left out)")
    p.add_argument("--warmup", type=int, default=2,
                   help="leading steps left out of the medians (the first two run 3-10x slower: warm-up)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--response-length", type=int, default=16)
    p.add_argument("--mini-batch", type=int, default=0, help="prompts per optimizer step (0: all, one step)")
    p.add_argument("--micro-batch", type=int, default=64, help="sequences per forward/backward per worker")
    p.add_argument("--workers", default="2", help="trainer.n_gpus_per_node (CPU worker slots), or auto: replicated "
                                                  "or one worker with every core, as the cost model predicts")
    p.add_argument("--rollout", default="vllm", choices=("vllm", "hf"))
    p.add_argument("--trl-python", nargs="?", const=sys.executable, default=None,
                   help="also measure TRL, run by this python (alone: this venv's, TRL installed when missing)")
    p.add_argument("--trl-beta", type=float, default=0.001, help="TRL beta in the KL mode (= kl_loss_coef)")
    p.add_argument("--trl-threads", type=int, default=0, help="torch threads for TRL (0: torch's default)")
    p.add_argument("--trl-args", default="", help="extra flags for trl_grpo_baseline.py, written --trl-args=\"--bf16\"")
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "bench-e2e"))
    p.add_argument("--no-skip-too", action="store_true",
                   help="in beta0 mode also run with actor.skip_zero_advantage=false (every row computed)")
    p.add_argument("--no-share-too", action="store_true",
                   help="also run with model.share_prompt_prefix=false (each sample forwards its own prompt), "
                        "combined with the --no-skip-too setting where both are given")
    p.add_argument("--both-dtypes", action="store_true",
                   help="also run ours in the dtype param_dtype=auto did not pick here (reference and rollout "
                        "follow the actor), and TRL in bf16 autocast too: like-for-like pairs in each dtype")
    p.add_argument("--shm-too", action="store_true",
                   help="also run ours with HYBRIDFLOW_SHM_COLLECTIVES=1 (Megatron TP all-reduces through "
                        "shared memory, hybridflow/shm_group.py), otherwise as the main run")
    p.add_argument("--dynamic-bsz-too", type=int, default=0, metavar="TOKENS",
                   help="also run with actor.use_dynamic_bsz=true and this ppo_max_token_len_per_gpu (micro-"
                        "batches by token budget in the update and the log-prob passes), otherwise as the main run")
    p.add_argument("--no-balance-too", action="store_true",
                   help="also run with trainer.balance_batch=false (rows dealt to the ranks in generation "
                        "order), otherwise as the main run")
    p.add_argument("--reward-ms", type=float, default=0.0,
                   help="score with a grader that takes this many ms per response (then the arithmetic scorer)")
    p.add_argument("--reward-busy", action="store_true", help="--reward-ms spent computing, not asleep")
    p.add_argument("--async-reward-too", action="store_true",
                   help="also run with reward_model.launch_reward_fn_async=true, otherwise as the main run")
    p.add_argument("--best-precision", action="store_true",
                   help="only ours / TRL at equal work (beta 0, every row computed), each at its best precision "
                        "here (param_dtype=auto's pick; both dtypes with --both-dtypes), interleaved; needs "
                        "--trl-python (scripts/bench/_equal_work.py)")
    p.add_argument("--repeat", type=int, default=1, help="--best-precision: interleaved rounds of the pair")
    p.add_argument("--attention", default="sdpa,eager",
                   help="--best-precision: comma list of attentions each side runs with, its faster one taken "
                        "(sdpa: transformers' default; eager: attn_implementation=eager on both sides)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run before giving up")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for every recipe run (after --)")
    args = p.parse_args(argv)
    args.sizes = [s for s in args.sizes.split(",") if s]
    args.modes = [m for m in args.modes.split(",") if m]
    args.attention = [a for a in args.attention.split(",") if a]
    if not args.attention or set(args.attention) - {"sdpa", "eager"}:
        p.error(f"--attention {','.join(args.attention)!r}: use a comma list of sdpa, eager")
    for s in args.sizes:
        if s not in SIZES:
            p.error(f"--sizes: unknown size {s!r}; use a comma list of {', '.join(SIZES)}")
    for m in args.modes:
        if m not in MODES:
            p.error(f"--modes: unknown mode {m!r}; use a comma list of {', '.join(MODES)}")
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup} to leave steps to measure")
    if args.best_precision and not args.trl_python:
        p.error("--best-precision compares with TRL: add --trl-python")
    if args.trl_python and not os.path.exists(args.trl_python):
        p.error(f"--trl-python {args.trl_python}: no such file")
    args.work_dir = os.path.abspath(args.work_dir)
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    paths = build_assets(args.work_dir, args.sizes)
    if args.trl_python:
        from _trl_common import ensure_trl  # this folder is sys.path[0] when run as a script

        ensure_trl(args.trl_python)
        # TRL's process inherits this one's oneDNN/ATen ISA caps (hybridflow/device.py sets them at import:
        # AVX512-BF16 at most, AVX2 under HYBRIDFLOW_CPU_ISA=avx2), so both sides run on the same kernels
        import hybridflow.device  # noqa: F401
    args.reward_overrides = reward_overrides(args)  # the grader's file is written once, for every run
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    args.auto_dtype = actor_dtype(args.overrides)
    report = {"setting": {"param_dtype": args.auto_dtype, "prompts": args.prompts, "samples": args.samples,
                          "response_length": args.response_length,
                          "steps": args.steps, "warmup_steps_excluded": args.warmup, "workers": args.workers,
                          "rollout": args.rollout, "mini_batch_prompts": args.mini_batch or args.prompts,
                          "reward_ms": args.reward_ms, "reward_busy": args.reward_busy,
                          "overrides": args.overrides, "cpus": os.cpu_count(), "load_avg_1m_at_start": load},
              "results": {}}
    if args.best_precision:
        from _equal_work import cpu_in_hand, run_equal_work

        report["setting"]["cpu"] = cpu_in_hand()
        args.modes = []  # equal work only
        for size in args.sizes:
            report["results"][f"{size}/equal_work"] = entry = run_equal_work(args, paths, size, run_ours, run_trl)
            entry["load_avg_1m_after"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
            print(f"[e2e] {size}/equal_work: {entry.get('best')} ratio {entry.get('ratio_to_trl_best_precision')}",
                  file=sys.stderr, flush=True)
    for size in args.sizes:
        for mode in args.modes:
            entry = {"hybridflow": run_ours(args, paths, size, mode)}
            if args.no_skip_too and not MODES[mode]:
                entry["hybridflow_no_skip"] = run_ours(args, paths, size, mode,
                                                       ("actor_rollout_ref.actor.skip_zero_advantage=false",), "-noskip")
            if args.no_share_too:
                no_share = ("actor_rollout_ref.model.share_prompt_prefix=false",)
                if args.no_skip_too and not MODES[mode]:  # the equal-work pair: every row computed
                    no_share += ("actor_rollout_ref.actor.skip_zero_advantage=false",)
                entry["hybridflow_no_share"] = run_ours(args, paths, size, mode, no_share, "-noshare")
            if args.dynamic_bsz_too:  # the "hybridflow" run again, micro-batches by token budget
                budget = ("actor_rollout_ref.actor.use_dynamic_bsz=true",
                          f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.dynamic_bsz_too}")
                entry["hybridflow_dynamic_bsz"] = run_ours(args, paths, size, mode, budget, "-dynbsz")
            if args.no_balance_too:  # the "hybridflow" run again, rows in generation order
                entry["hybridflow_no_balance"] = run_ours(args, paths, size, mode, ("trainer.balance_batch=false",),
                                                          "-nobalance")
            if args.async_reward_too:  # the "hybridflow" run again, scored in the reward process
                entry["hybridflow_async_reward"] = run_ours(args, paths, size, mode,
                                                            ("reward_model.launch_reward_fn_async=true",), "-async")
            if args.both_dtypes:  # the "hybridflow" run again in the other dtype (every row computed
                other = "fp32" if args.auto_dtype == "bf16" else "bf16"  # in beta 0 with --no-skip-too)
                flip = (f"actor_rollout_ref.actor.param_dtype={other}",)
                if args.no_skip_too and not MODES[mode]:
                    flip += ("actor_rollout_ref.actor.skip_zero_advantage=false",)
                entry[f"hybridflow_{other}"] = run_ours(args, paths, size, mode, flip, f"-{other}")
            if args.shm_too:  # the "hybridflow" run again, shared-memory TP all-reduces on
                entry["hybridflow_shm"] = run_ours(args, paths, size, mode, (), "-shm",
                                                   {"HYBRIDFLOW_SHM_COLLECTIVES": "1"})
            if args.trl_python:
                entry["trl"] = run_trl(args, paths, size, mode)
                entry["trl_source"] = "measured in this invocation"
                if args.both_dtypes:
                    entry["trl_bf16"] = run_trl(args, paths, size, mode, ("--bf16",))
            elif size == "medium":
                entry["trl"] = TRL_QUOTED[mode]
                entry["trl_source"] = "issue 6 figures, NOT measured here"
            ours, trl = entry["hybridflow"].get("step_s"), (entry.get("trl") or {}).get("step_s")
            dynamic = entry.get("hybridflow_dynamic_bsz", {}).get("step_s")
            if ours and dynamic:
                entry["dynamic_bsz_to_fixed"] = round(dynamic / ours, 3)
            overlapped = entry.get("hybridflow_async_reward", {}).get("step_s")
            if ours and overlapped:
                entry["async_reward_to_inline"] = round(overlapped / ours, 3)
            unbalanced = entry.get("hybridflow_no_balance", {}).get("step_s")
            if ours and unbalanced:
                entry["balanced_to_unbalanced"] = round(ours / unbalanced, 3)
            if ours and trl:
                entry["ratio_to_trl"] = round(ours / trl, 3)
                entry["goal_ratio"] = 0.5
                no_skip = entry.get("hybridflow_no_skip", {}).get("step_s")
                if no_skip:
                    entry["ratio_to_trl_no_skip"] = round(no_skip / trl, 3)
                if args.both_dtypes:  # "ratio_to_trl" is the issue's: our default against TRL in fp32
                    no_skip = entry.get("hybridflow_no_skip", {}).get("step_s")
                    by_dtype = {args.auto_dtype: no_skip or ours}
                    for dtype in ("fp32", "bf16"):
                        by_dtype.setdefault(dtype, entry.get(f"hybridflow_{dtype}", {}).get("step_s"))
                    trl_bf16 = entry.get("trl_bf16", {}).get("step_s")
                    if by_dtype["fp32"]:
                        entry["ratio_fp32_to_trl_fp32"] = round(by_dtype["fp32"] / trl, 3)
                    if by_dtype["bf16"] and trl_bf16:
                        entry["ratio_bf16_to_trl_bf16"] = round(by_dtype["bf16"] / trl_bf16, 3)
                shm = entry.get("hybridflow_shm", {}).get("step_s")
                if shm:
                    entry["ratio_to_trl_shm"] = round(shm / trl, 3)
                no_share = entry.get("hybridflow_no_share", {}).get("step_s")
                if no_share:
                    entry["ratio_to_trl_no_share"] = round(no_share / trl, 3)
            entry["load_avg_1m_after"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
            report["results"][f"{size}/{mode}"] = entry
            print(f"[e2e] {size}/{mode}: ours {ours} s/step, trl {trl}", file=sys.stderr, flush=True)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    report["load_avg_1m_at_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    loads = [load, report["load_avg_1m_at_end"]] + [e.get("load_avg_1m_after") for e in report["results"].values()]
    if max(x or 0.0 for x in loads) > (os.cpu_count() or 1):
        # Our workers run 1 thread each; TRL runs one process with one thread per core, whose OpenMP
        # barriers wait on preempted threads. Measured here at load ~20 on 2 cores: TRL's medium step
        # went from 3.6 s to 96 s, ours from 6.2 s to 19 s. A busy machine flatters the ratio.
        report["warning"] = ("machine busy (load average above the core count): times are inflated and the "
                             "ratio to TRL is biased in our favour; re-run on an idle machine")
    print(json.dumps(report, indent=2))
    return 0 if all("error" not in e.get("hybridflow", {}) for e in report["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
