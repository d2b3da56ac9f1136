"""TRL's GRPOTrainer, timed per step: the baseline of the e2e bench (issue 6) and of the long-tail
bench (issue 32), on the arithmetic or the counting task.

    .venv/bin/python scripts/bench/trl_grpo_baseline.py --task arithmetic --model M --data D/train.parquet
    .venv/bin/python scripts/bench/trl_grpo_baseline.py --task count --prompts 16 --samples 8 \
        --max-completion-length 256 --model M --data data/count/train.parquet

TRL runs in hybridflow's venv (never imported by the package, only by this script, in its own
process); ``e2e.py --trl-python`` and ``longtail.py`` install it there when missing
(``_trl_common.ensure_trl``, torch and transformers pinned) and call this script themselves.
Setting, matched to our recipe run: the same checkpoint and char tokenizer, the same prompts
(plain text, no chat template: the char tokenizer has none), ``--prompts`` x ``--samples``
generations per step, one optimizer step per generation (steps_per_generation=1,
num_iterations=1: strictly on-policy, so TRL computes no old log-probs), fp32 on CPU and no
gradient checkpointing unless asked (TRL's own defaults are bf16 autocast and gradient
checkpointing: ``--bf16 --gradient-checkpointing``), temperature 1, top_p 1, HF ``generate``
(use_vllm=False), and the reward is hybridflow's for the task, loaded from its file so both
frameworks score identically.

Prints one JSON line: medians over the steps after ``--warmup`` of the whole step, of generation
(``_generate``: tokenize + sample + decode), of the reference forward, ``train_s`` = step - gen
(issue 6 splits TRL's 4.3 s as 1.2 s generating + 3.1 s training this way) and ``gen_share`` =
gen / step; the completion lengths (tokens, EOS included, as TRL counts them): per step their
p50/p80/p95/max, and the median of each over the measured steps (as longtail.py reads our
``response_length/p*``); and ``gen_tail_share_est_from_lengths``: HF ``generate`` decodes the
whole batch until its longest completion ends, at about the same cost per decode step, so the
share of a generate call spent after the median completion ended is estimated as (longest -
median) / longest, from the lengths alone (no timestamps; ours, ``perf/gen_tail_share``, is timed).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _trl_common import REPO, load_policy, load_prompts, reward_func  # this folder is sys.path[0] when run as a script

PERCENTILES = (50, 80, 95)


class StageClock:
    """Wraps trainer methods to time stages; a TrainerCallback closes each optimizer step."""

    def __init__(self):
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def add(self, key: str, seconds: float) -> None:
        self.current[key] = self.current.get(key, 0.0) + seconds

    def wrap(self, obj, name: str, key, when=None, keep=None) -> None:
        """Replace ``obj.name`` by a timed call; ``key`` names the stage; ``when(args)`` filters;
        ``keep(result)`` returns {field: list} to append to the current step's record."""
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            if when is not None and not when(args):
                return inner(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                result = inner(*args, **kwargs)
            finally:
                self.add(key, time.perf_counter() - t0)
            for field, values in (keep(result) if keep else {}).items():
                self.current.setdefault(field, []).extend(values)
            return result

        setattr(obj, name, timed)


def length_stats(lengths: list[int]) -> dict[str, float]:
    """p50/p80/p95 (numpy's linear interpolation, as our response_length/p*) and max of one step's
    completion lengths."""
    import numpy as np

    out = {f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(lengths, PERCENTILES))}
    return {**out, "max": float(max(lengths))}


def tail_share_estimate(lengths: list[int]) -> float:
    """The share of one HF generate call spent after its median completion ended, from lengths:
    generate runs the batch until its longest completion ends, at about constant cost per decode
    step (the finished rows still ride along), so (longest - median) / longest."""
    longest = max(lengths)
    return (longest - statistics.median(lengths)) / longest if longest else 0.0


def summarise_lengths(steps: list[dict]) -> dict:
    """The median over ``steps`` of each step's length percentiles and tail estimate (each step's
    ``lengths`` are its one generate call's)."""
    per_step = [{**length_stats(s["lengths"]), "tail": tail_share_estimate(s["lengths"])}
                for s in steps if s.get("lengths")]
    if not per_step:
        return {}
    med = {k: statistics.median(s[k] for s in per_step) for k in per_step[0]}
    return {"completion_length": {k: round(v, 1) for k, v in med.items() if k != "tail"},
            "gen_tail_share_est_from_lengths": round(med["tail"], 3)}


def make_callback(clock: StageClock):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.current = {"_t0": time.perf_counter()}

        def on_step_end(self, args, state, control, **kwargs):
            step = time.perf_counter() - clock.current.pop("_t0")
            clock.steps.append({"step_s": step, **clock.current})

    return StepTimer()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench = os.path.join(REPO, "runs", "bench-e2e")  # where e2e.py builds its model and data
    p.add_argument("--task", default="arithmetic", choices=("arithmetic", "count"),
                   help="the data_source whose reward scores the completions")
    p.add_argument("--model", default=os.path.join(bench, "models", "qwen2-medium"),
                   help="an HF checkpoint folder with hybridflow's char tokenizer (default: e2e.py's medium model)")
    p.add_argument("--data", default=os.path.join(bench, "data", "train.parquet"),
                   help="the task's train.parquet in verl's schema (default: e2e.py's arithmetic one)")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient; > 0 loads a reference model")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="leading steps left out of the medians")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (TRL's CPU default); off: fp32")
    p.add_argument("--attn-implementation", default=None, choices=("sdpa", "eager"),
                   help="the model's attention (transformers' default: sdpa, torch's flash kernel on a CPU)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="TRL's default (recomputes activations in backward); off: like our recipe's default")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--output-dir", default=os.path.join(REPO, "runs", "bench-e2e", "trl"))
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup} to leave steps to measure")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import torch
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as err:
        # Not an error for `make bench` in a venv without TRL: the baseline is optional.
        print(json.dumps({"skipped": f"{err}: e2e.py --trl-python or longtail.py install TRL into this "
                                     "venv (_trl_common.ensure_trl)"}))
        return 0
    for flag, path in (("--model", os.path.join(args.model, "config.json")), ("--data", args.data)):
        if not os.path.exists(path):
            print(f"trl_grpo_baseline: {flag}: {path} does not exist; run scripts/bench/e2e.py (arithmetic) "
                  f"or longtail.py (count) once (they build the model and data) or pass {flag}", file=sys.stderr)
            return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(args.model, args.attn_implementation)
    sequences = args.prompts * args.samples
    config = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.lr,
        per_device_train_batch_size=sequences, gradient_accumulation_steps=1, steps_per_generation=1,
        num_iterations=1, num_generations=args.samples, max_completion_length=args.max_completion_length,
        temperature=1.0, top_p=1.0, beta=args.beta, use_vllm=False, use_cpu=True, bf16=args.bf16,
        logging_steps=1, report_to="none", save_strategy="no", seed=0, dataloader_num_workers=0,
        log_completions=False, disable_tqdm=True, gradient_checkpointing=args.gradient_checkpointing,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward_func(args.task), args=config,
                          train_dataset=load_prompts(args.data), processing_class=tokenizer)
    clock = StageClock()
    # _generate returns (prompt_ids, completion_ids, ...); a completion's ids end at its EOS, included
    clock.wrap(trainer, "_generate", "gen_s", keep=lambda out: {
        "lengths": [len(ids) for ids in out[1]], "tokens": [sum(len(p) + len(c) for p, c in zip(out[0], out[1]))]})
    clock.wrap(trainer, "_generate_and_score_completions", "prepare_s")
    if trainer.ref_model is not None:
        ref = trainer.ref_model
        clock.wrap(trainer, "_get_per_token_logps_and_entropies", "ref_s", when=lambda a: a and a[0] is ref)
    trainer.add_callback(make_callback(clock))
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0

    measured = clock.steps[args.warmup:] or clock.steps
    med = {k: statistics.median(s.get(k, 0.0) for s in measured) for k in ("step_s", "gen_s", "prepare_s", "ref_s")}
    print(json.dumps({
        "framework": f"trl {trl.__version__}", "torch": torch.__version__, "threads": torch.get_num_threads(),
        "dtype": "bf16 autocast" if args.bf16 else "fp32", "beta": args.beta, "reference_model": trainer.ref_model is not None,
        "gradient_checkpointing": args.gradient_checkpointing,
        "attn_implementation": model.config._attn_implementation,
        "steps_measured": len(measured),
        "task": args.task, "prompts": args.prompts, "samples": args.samples,
        "max_completion_length": args.max_completion_length,
        "step_s": round(med["step_s"], 4), "gen_s": round(med["gen_s"], 4),
        "gen_share": round(med["gen_s"] / med["step_s"], 3),
        # prompt + completion tokens (no padding) per second of step, as our perf/total_num_tokens / step
        "tokens_per_s": round(statistics.median(sum(s.get("tokens", [0])) for s in measured) / med["step_s"], 1),
        "ref_s": round(med["ref_s"], 4), "train_s": round(med["step_s"] - med["gen_s"], 4),
        "score_and_logprob_s": round(med["prepare_s"] - med["gen_s"], 4),
        **summarise_lengths(measured),
        "per_step": [{k: round(v, 4) if k not in ("lengths", "tokens") else
                      sum(v) if k == "tokens" else {**length_stats(v), "mean": round(statistics.mean(v), 1)}
                      for k, v in s.items()} for s in clock.steps],
        "train_wall_s": round(wall, 1),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
