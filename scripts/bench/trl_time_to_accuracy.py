"""TRL's GRPOTrainer until its greedy validation score reaches a target: the TRL side of
``time_to_accuracy.py`` (issue 32 item 3), which runs this in its own process.

TRL keeps ITS OWN defaults (GRPOConfig: bf16 autocast, gradient checkpointing, the DAPO loss, a
linear LR decay over 3 epochs, 8 completions per device step, ...) except what the comparison
fixes: the model (loaded in the checkpoint's fp32, as ours loads it), the training prompts and
the run's length in prompts (``--max-prompts``, ours; it sets max_steps, which TRL's linear LR
decay spans), the learning rate, ``num_generations`` (our rollout.n), ``max_completion_length`` (our
max_response_length), use_cpu and the seed. ``--prompts-per-step P`` also sets our batch
(``per_device_train_batch_size = P * num_generations``), since TRL's default batch is 1 prompt per
step where ours is 16 or 64.

Validation is ours, done by a TrainerCallback: before the first step and every
``--val-every-prompts`` training prompts (the same prompts consumed between our validations), the
policy greedily completes every validation prompt (``model.generate``, do_sample=False, batched,
left padding, up to max_completion_length new tokens) in our run's dtype (``--val-dtype``: fp32
outside TRL's bf16 autocast, as the demo; bf16 inside it where ours runs bf16), our reward file
scores the text, and the mean is the ``val_score``: at step 0 it equals our recipe's
(0.3711 on the demo). Training stops (``control.should_training_stop``) at the first score >=
``--target``, or once ``--max-seconds`` have passed since ``--launch-time``.

Each validation appends one JSON line to ``--out`` (and stdout): step, prompts consumed, seconds
since launch, train_s (the optimizer steps' time so far, validation and startup excluded), val_s
(that validation's own time) and val_score. The last line is a summary (``"done": true``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _trl_common import load_policy, load_prompts, load_score, reward_func, steps_between_validations  # noqa: E402


def greedy_val_score(model, tokenizer, prompts, truths, score, max_new_tokens: int, batch: int,
                     fp32: bool = True) -> float:
    """Mean reward of greedy completions: what our validation does (rollout.val_kwargs.do_sample=false).
    ``fp32=False`` keeps TRL's bf16 autocast, for a comparison where our run's weights are bf16."""
    import torch
    from transformers import GenerationConfig

    # a fresh config: TRL sets sampling knobs on the model's own generation_config
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, use_cache=True,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    was_training, wrapped = model.training, model.forward
    model.eval()
    # accelerate wraps forward in TRL's bf16 autocast (_original_forward is the unwrapped one): our
    # validation runs the fp32 weights in fp32, as the demo's vLLM does (bf16 greedy lost 2 of 256)
    unwrapped = getattr(model, "_original_forward", None) if fp32 else None
    if unwrapped is not None:
        model.forward = unwrapped
    total = 0.0
    try:
        with torch.no_grad():
            for i in range(0, len(prompts), batch):
                enc = tokenizer(prompts[i:i + batch], return_tensors="pt", padding=True, padding_side="left")
                out = model.generate(**enc, generation_config=gen)
                texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                total += sum(float(score(t, gt)) for t, gt in zip(texts, truths[i:i + batch]))
    finally:
        if unwrapped is not None:
            model.forward = wrapped
        model.train(was_training)
    return total / len(prompts)


def make_callback(args, val_every_steps: int, prompts_per_step: int, tokenizer, val_rows, score, emit):
    from transformers import TrainerCallback

    prompts, truths = list(val_rows["prompt"]), list(val_rows["ground_truth"])

    class ValidateUntilTarget(TrainerCallback):
        """Validates at step 0 and every ``val_every_steps``; stops at the target or the time cap."""

        def __init__(self):
            self.train_s, self.step_t0, self.best, self.reached, self.startup_s = 0.0, None, None, False, None

        def _validate(self, step, model, control):
            t0 = time.perf_counter()
            val = greedy_val_score(model, tokenizer, prompts, truths, score, args.max_completion_length,
                                   args.val_batch, fp32=args.val_dtype == "fp32")
            row = {"step": step, "prompts": step * prompts_per_step,
                   "seconds": round(time.time() - args.launch_time, 2), "train_s": round(self.train_s, 2),
                   "val_s": round(time.perf_counter() - t0, 2), "val_score": round(val, 4)}
            emit(row)
            if self.best is None or val > self.best["val_score"]:
                self.best = row
            if val >= args.target:
                self.reached = True
                control.should_training_stop = True

        def on_train_begin(self, args_, state, control, model=None, **kwargs):
            self.startup_s = time.time() - args.launch_time
            self._validate(0, model, control)

        def on_step_begin(self, args_, state, control, **kwargs):
            self.step_t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, model=None, **kwargs):
            self.train_s += time.perf_counter() - self.step_t0
            if state.global_step % val_every_steps == 0:
                self._validate(state.global_step, model, control)
            if time.time() - args.launch_time > args.max_seconds:
                control.should_training_stop = True

    return ValidateUntilTarget()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint folder with hybridflow's char tokenizer")
    p.add_argument("--train", required=True, help="train.parquet in verl's schema")
    p.add_argument("--val", required=True, help="val.parquet in verl's schema")
    p.add_argument("--data-source", required=True, help="the reward: arithmetic or count")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--num-generations", type=int, required=True)
    p.add_argument("--max-completion-length", type=int, required=True)
    p.add_argument("--prompts-per-step", type=int, default=0, help="0: TRL's default batch")
    p.add_argument("--val-every-prompts", type=int, required=True, help="training prompts between validations")
    p.add_argument("--max-prompts", type=int, required=True,
                   help="training prompts of the whole run (ours: total_training_steps x train_batch_size)")
    p.add_argument("--target", type=float, required=True)
    p.add_argument("--max-seconds", type=float, default=480.0, help="since --launch-time")
    p.add_argument("--launch-time", type=float, default=None, help="epoch seconds the caller launched us at")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="validate in fp32 or under TRL's bf16 autocast: our run's param_dtype")
    p.add_argument("--val-batch", type=int, default=128, help="validation prompts per generate call")
    p.add_argument("--out", required=True, help="JSON lines: one per validation, then a summary")
    p.add_argument("--output-dir", required=True, help="TRL's output_dir (nothing is saved there)")
    args = p.parse_args(argv)
    args.launch_time = args.launch_time or time.time()
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import trl
    from trl import GRPOConfig, GRPOTrainer

    out = open(args.out, "w")

    def emit(row):
        line = json.dumps(row)
        print(line, flush=True)
        out.write(line + "\n")
        out.flush()

    model, tokenizer = load_policy(args.model)
    batch = ({"per_device_train_batch_size": args.prompts_per_step * args.num_generations}
             if args.prompts_per_step else {})
    config = GRPOConfig(output_dir=args.output_dir, learning_rate=args.lr, num_generations=args.num_generations,
                        max_completion_length=args.max_completion_length, use_cpu=True, seed=args.seed,
                        report_to="none", save_strategy="no", disable_tqdm=True, **batch)
    # prompts per optimizer step, one process: each device step holds num_generations completions per prompt
    prompts_per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps // config.num_generations
    val_every = steps_between_validations(args.val_every_prompts, prompts_per_step)
    # the run's length (and so the span of TRL's linear LR decay) in prompts, as long as ours: TRL's
    # default of 3 epochs ended the demo at our batch after 96 steps, before either reached 0.6
    config.max_steps = steps_between_validations(args.max_prompts, prompts_per_step)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_func(args.data_source), args=config,
                          train_dataset=load_prompts(args.train), processing_class=tokenizer)
    callback = make_callback(args, val_every, prompts_per_step, tokenizer, load_prompts(args.val),
                             load_score(args.data_source), emit)
    trainer.add_callback(callback)
    trainer.train()
    emit({"done": True, "framework": f"trl {trl.__version__}", "reached": callback.reached,
          "steps": trainer.state.global_step, "prompts_per_step": prompts_per_step, "val_every_steps": val_every,
          "startup_s": round(callback.startup_s, 2), "seconds": round(time.time() - args.launch_time, 2),
          "best": callback.best, "bf16": config.bf16, "gradient_checkpointing": config.gradient_checkpointing,
          "loss_type": config.loss_type, "val_dtype": args.val_dtype, "beta": config.beta,
          "lr_scheduler": str(config.lr_scheduler_type)})
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
