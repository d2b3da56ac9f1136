"""The training engines on one GPU against a plain PyTorch loop of the HF model, at equal work.

One GPU holds one NCCL rank, so this measures what the engine itself costs per rank: its
micro-batch bookkeeping, loss plumbing, gradient clipping, optimizer and (FSDP on one rank: DDP)
the gradient all-reduce call, with no communication to hide it. On CPU the same question is
``scripts/bench/engines.py`` (2 ranks, where communication dominates).

Work per step, identical on every side: a Qwen2-shaped causal LM (default: Qwen2.5-0.5B's
shape, random weights), ``--rows`` rows of ``--prompt`` + ``--response`` real tokens (no padding),
response-token NLL (token mean), backward, grad clip 1.0, AdamW (fused). The engines run one
micro-batch of all rows, as the plain loop does.

- ``plain``: the HF model in fp32 under ``torch.autocast(bfloat16)`` (``--dtype bf16``, the
  textbook mixed precision) or plain fp32 (``--dtype fp32``), logits kept for the response only.
- ``fsdp``: FSDPEngine (one rank), ``param_dtype`` = ``--dtype`` (bf16: bf16 compute, fp32
  master weights and optimizer state).
- ``megatron``: MegatronEngine, tp = pp = 1, the same dtype.
- ``*_log_prob``: forward-only response log-probs (the old/ref log-prob pass of RL), ``plain``
  under ``torch.no_grad``.

Measurements interleave (plain, fsdp, megatron in rotating order, ``--rounds`` x ``--steps``),
each timed with CUDA synchronisation; overhead = 1 - engine / plain tokens/s, the median of
per-round ratios. Prints JSON; without a GPU it prints why it did not run.

    python scripts/bench/engines_gpu.py --out engines_gpu.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engines import make_batch, nll_loss_fn  # noqa: E402  (this folder)

from hybridflow import device as hf_device  # noqa: E402
from hybridflow.ports import free_rendezvous_port  # noqa: E402

GOAL_MAX_OVERHEAD = 0.10
SIDES = ("plain", "fsdp", "megatron")


def plain_side(args, data):
    """Textbook loop: returns (train_step, log_prob_pass)."""
    from transformers import AutoModelForCausalLM

    device = hf_device.torch_device(0)
    model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.float32).to(device)
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    b = data.to(device).batch
    resp_len = b["responses"].shape[1]
    mask = b["response_mask"].float()
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if args.dtype == "bf16" \
        else contextlib.nullcontext

    def log_probs():
        with autocast():
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                           position_ids=b["position_ids"], logits_to_keep=resp_len + 1).logits[:, :resp_len]
        return torch.log_softmax(logits.float(), -1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = -(log_probs() * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    def infer():
        with torch.no_grad():
            log_probs()
    return step, infer


def engine_side(args, strategy, data):
    from workers.engines.config import EngineConfig

    config = EngineConfig(strategy=strategy, lr=args.lr, weight_decay=0.01, grad_clip=1.0,
                          micro_batch_size_per_gpu=args.rows, param_dtype=args.dtype, seed=0)
    if strategy == "fsdp":
        from workers.engines.fsdp import FSDPEngine

        engine = FSDPEngine(config, args.ckpt, "actor")
    else:
        from workers.engines.megatron import MegatronEngine

        engine = MegatronEngine(config, args.ckpt, "actor")
    return (lambda: engine.train_batch(data, nll_loss_fn)), (lambda: engine.compute_log_prob(data, 1.0))


def timed(fn, steps):
    times = []
    for _ in range(steps):
        hf_device.synchronize()
        start = time.perf_counter()
        fn()
        hf_device.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_profiles(folder: str, fns: dict, on_gpu: bool) -> None:
    """One training step and one log-prob pass per side under torch.profiler: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(folder, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    sort = "cuda_time_total" if on_gpu else "cpu_time_total"
    for side, (step, infer) in fns.items():
        for label, fn in (("step", step), ("log_prob", infer)):
            hf_device.synchronize()
            with profile(activities=activities) as prof:
                fn()
                hf_device.synchronize()
            with open(os.path.join(folder, f"profile_{side}_{label}.txt"), "w") as f:
                f.write(prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=60))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=768)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also write each side's top kernels for one training step (torch.profiler) to DIR")
    p.add_argument("--allow-cpu", action="store_true", help="run on CPU where no GPU is visible (a smoke test "
                   "of this script at a small --hidden/--layers/--vocab; the numbers mean nothing)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    on_gpu = hf_device.device_type() == "cuda"
    if not on_gpu and not args.allow_cpu:
        result = {"skipped": "no GPU visible: this benchmark measures the engines on CUDA; "
                             "scripts/bench/engines.py is the CPU one"}
        print(json.dumps(result))
        return result
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_rendezvous_port("127.0.0.1")),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    hf_device.init_distributed(timeout_s=600)
    from hybridflow.tiny import make_tiny_checkpoint

    tokens = args.rows * (args.prompt + args.response)
    with tempfile.TemporaryDirectory() as tmp:
        args.ckpt = make_tiny_checkpoint(
            os.path.join(tmp, "model"), arch="qwen2", tied=True, hidden=args.hidden, layers=args.layers,
            heads=args.heads, kv_heads=args.kv_heads, intermediate=args.intermediate, vocab_size=args.vocab,
            max_positions=max(512, args.prompt + args.response))
        data = make_batch(args.rows, args.prompt, args.response, args.vocab)
        fns, memory = {}, {}
        for side in SIDES:
            before = hf_device.allocated_memory_bytes()
            hf_device.reset_peak_memory()
            fns[side] = plain_side(args, data) if side == "plain" else engine_side(args, side, data)
            for _ in range(args.warmup):
                fns[side][0]()
                fns[side][1]()
            hf_device.synchronize()
            if on_gpu:  # models and optimizers of the sides built earlier stay allocated: subtract them
                memory[side] = {"resident_bytes": hf_device.allocated_memory_bytes() - before,
                                "step_peak_bytes": hf_device.peak_memory_bytes() - before}
        if args.profile:
            write_profiles(args.profile, fns, on_gpu)
        rounds = []
        for r in range(args.rounds):
            order = SIDES[r % 3:] + SIDES[:r % 3]
            per = {}
            for side in order:
                per[side] = tokens / timed(fns[side][0], args.steps)
                per[side + "_log_prob"] = tokens / timed(fns[side][1], args.steps)
            rounds.append(per)

    def median(key):
        return statistics.median(r[key] for r in rounds)

    def overhead(key, base):
        return round(1 - statistics.median(r[key] / r[base] for r in rounds), 3)

    result = {
        "device": hf_device.device_name() if on_gpu else "cpu (smoke test only)",
        "model": {"arch": "qwen2", "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                  "kv_heads": args.kv_heads, "intermediate": args.intermediate, "vocab": args.vocab,
                  "tied": True, "dtype": args.dtype},
        "batch": {"rows": args.rows, "prompt_tokens": args.prompt, "response_tokens": args.response,
                  "tokens_per_step": tokens, "micro_batches": 1},
        "timing": {"warmup": args.warmup, "rounds": args.rounds, "steps_per_round": args.steps},
        "tokens_per_s": {k: round(median(k), 1) for k in rounds[0]},
        "overhead_vs_plain": {k: overhead(k, "plain") for k in ("fsdp", "megatron")},
        "log_prob_overhead_vs_plain": {k: overhead(k + "_log_prob", "plain_log_prob") for k in ("fsdp", "megatron")},
        "memory": memory,
        "per_round_tokens_per_s": [{k: round(v, 1) for k, v in r.items()} for r in rounds],
        "goal": {"max_overhead": GOAL_MAX_OVERHEAD},
    }
    result["goal"]["met"] = {k: v < GOAL_MAX_OVERHEAD for k, v in result["overhead_vs_plain"].items()}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
