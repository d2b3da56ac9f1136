"""TRL's GRPOTrainer on the e2e benchmark's setting, timed per step: the baseline of issue 6.

Runs in its OWN virtual environment (TRL pins its own transformers/accelerate; hybridflow's venv
does not carry it):

    python3 -m venv /tmp/trl-venv
    /tmp/trl-venv/bin/pip install torch==2.13.0          # first, so no CUDA build is pulled
    /tmp/trl-venv/bin/pip install 'trl==1.16.*' transformers datasets accelerate pandas pyarrow
    /tmp/trl-venv/bin/python scripts/bench/trl_grpo_baseline.py --model M --data D/train.parquet --beta 0

``scripts/bench/e2e.py --trl-python /tmp/trl-venv/bin/python`` builds the model and data and calls
this script itself. Setting, matched to our recipe run: the same seeded checkpoint and char
tokenizer, the same arithmetic prompts (plain text, no chat template: the char tokenizer has
none), 32 prompts x 4 generations per step, completions up to 16 tokens, one optimizer step per
generation (steps_per_generation=1, num_iterations=1: strictly on-policy, so TRL computes no old
log-probs), fp32 on CPU and no gradient checkpointing, like our recipe's defaults (TRL's own
defaults are bf16 autocast and gradient checkpointing: ``--bf16 --gradient-checkpointing``), HF
``generate`` (use_vllm=False), and the reward is hybridflow's arithmetic score, loaded from its
file so both frameworks score identically.

Prints one JSON line: medians over the steps after ``--warmup`` of the whole step, of generation
(``_generate``: tokenize + sample + decode), of the reference forward, and ``train_s`` = step - gen
(issue 6 splits TRL's 4.3 s as 1.2 s generating + 3.1 s training this way).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_arithmetic_score():
    """hybridflow's arithmetic compute_score, imported from its file (it needs only ``re``), so the
    TRL venv needs no hybridflow install and the reward is the same code as in our recipe."""
    path = os.path.join(REPO, "hybridflow", "rewards", "arithmetic.py")
    spec = importlib.util.spec_from_file_location("hf_arithmetic_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


def load_prompts(parquet: str):
    """verl-schema rows -> a datasets.Dataset with a plain-text ``prompt`` and its ``ground_truth``."""
    import pandas as pd
    from datasets import Dataset

    rows = pd.read_parquet(parquet)
    prompts = [list(p)[-1]["content"] for p in rows["prompt"]]
    truths = [str(r["ground_truth"]) for r in rows["reward_model"]]
    return Dataset.from_dict({"prompt": prompts, "ground_truth": truths})


class StageClock:
    """Wraps trainer methods to time stages; a TrainerCallback closes each optimizer step."""

    def __init__(self):
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def add(self, key: str, seconds: float) -> None:
        self.current[key] = self.current.get(key, 0.0) + seconds

    def wrap(self, obj, name: str, key, when=None) -> None:
        """Replace ``obj.name`` by a timed call; ``key`` names the stage; ``when(args)`` filters."""
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            if when is not None and not when(args):
                return inner(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.add(key, time.perf_counter() - t0)

        setattr(obj, name, timed)


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
    p.add_argument("--model", default=os.path.join(bench, "models", "qwen2-medium"),
                   help="an HF checkpoint folder with hybridflow's char tokenizer (default: e2e.py's medium model)")
    p.add_argument("--data", default=os.path.join(bench, "data", "train.parquet"),
                   help="arithmetic train.parquet in verl's schema (default: e2e.py's)")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient; > 0 loads a reference model")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="leading steps left out of the medians")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (TRL's CPU default); off: fp32")
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
        from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as err:
        # Not an error for `make bench`, whose venv has no TRL: the baseline is optional.
        print(json.dumps({"skipped": f"{err}: run this with a python that has trl installed (see the "
                                     "docstring), or e2e.py --trl-python /tmp/trl-venv/bin/python"}))
        return 0
    for flag, path in (("--model", os.path.join(args.model, "config.json")), ("--data", args.data)):
        if not os.path.exists(path):
            print(f"trl_grpo_baseline: {flag}: {path} does not exist; run scripts/bench/e2e.py once "
                  f"(it builds the model and data) or pass {flag}", file=sys.stderr)
            return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    compute_score = load_arithmetic_score()

    def arithmetic_reward(completions, ground_truth, **_):
        return [compute_score(c, gt) for c, gt in zip(completions, ground_truth)]

    # transformers 5 ignores a custom tokenizer.json under a qwen2 config with AutoTokenizer
    # (docs/environment.md), so load the char tokenizer as what it is.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    sequences = args.prompts * args.samples
    config = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.lr,
        per_device_train_batch_size=sequences, gradient_accumulation_steps=1, steps_per_generation=1,
        num_iterations=1, num_generations=args.samples, max_completion_length=args.max_completion_length,
        temperature=1.0, top_p=1.0, beta=args.beta, use_vllm=False, use_cpu=True, bf16=args.bf16,
        logging_steps=1, report_to="none", save_strategy="no", seed=0, dataloader_num_workers=0,
        log_completions=False, disable_tqdm=True, gradient_checkpointing=args.gradient_checkpointing,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=config,
                          train_dataset=load_prompts(args.data), processing_class=tokenizer)
    clock = StageClock()
    clock.wrap(trainer, "_generate", "gen_s")
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
        "steps_measured": len(measured),
        "step_s": round(med["step_s"], 4), "gen_s": round(med["gen_s"], 4),
        "ref_s": round(med["ref_s"], 4), "train_s": round(med["step_s"] - med["gen_s"], 4),
        "score_and_logprob_s": round(med["prepare_s"] - med["gen_s"], 4),
        "per_step": [{k: round(v, 4) for k, v in s.items()} for s in clock.steps], "train_wall_s": round(wall, 1),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
