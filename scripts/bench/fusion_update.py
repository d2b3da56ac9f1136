"""Fused actor-critic update (RLHFuse's intra-stage fusion, arXiv 2409.13221) vs the actor's update
then the critic's, on 2 processes with Megatron tp=1 pp=2 (issue 34 item 3).

Both pairs of engines start from the same checkpoint (the e2e bench's medium shape, seeded) and take
the same optimizer steps on the same PPO batch, shaped like the long-tail workload: 128 rows,
prompts up to 24 tokens, responses of 3-31 tokens (82%) or a power-law tail up to 255 (18%),
rows in random order, one mini-batch, ``micro_batch_size_per_gpu`` rows per micro-batch. The
sequential pair is a plain actor and a plain critic (``train_batch`` one after the other); the
fused pair is a plain actor and a reversed critic (``fused_train_batch``). Each repetition times
both (alternating which goes first); the first is warm-up. Dtype: what ``param_dtype=auto``
resolves to on this CPU (``--dtype`` to choose). One thread per rank (2 ranks on 2 cores).

    flock /tmp/hf_cpu.lock .venv/bin/python scripts/bench/fusion_update.py [--repeats 4] [--micro 4]

Prints one JSON: medians of both, ``ratio_fused_over_sequential`` (goal <= 0.85), the seconds each
rank waited for pipeline messages per update (median), the max abs weight difference between the
two pairs after all steps, and the CPU flags the numbers depend on. ``measure(argv)`` returns it.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(BENCH))
sys.path.insert(0, REPO)
sys.path.insert(0, BENCH)

from e2e import SIZES  # noqa: E402

PROMPT, RESPONSE, VOCAB_LO = 24, 256, 3


def longtail_batch(rows: int, vocab: int, seed: int = 0):
    """A PPO batch with the long-tail workload's lengths (docs/benchmarks.md "Long-tail workload")."""
    import torch

    from hybridflow.protocol import DataProto

    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(rows, PROMPT + RESPONSE, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i in range(rows):
        p = int(torch.randint(12, PROMPT + 1, (1,), generator=gen))
        if float(torch.rand(1, generator=gen)) < 0.82:
            n = int(torch.randint(1, 9, (1,), generator=gen))
        else:  # power-law tail of 9-64 numbers: P(n) ~ n^-2
            u = float(torch.rand(1, generator=gen))
            n = min(64, int(9 / (1 - u * (1 - 9 / 65))))
        r = min(RESPONSE, 4 * n - 1)
        ids[i, PROMPT - p: PROMPT + r] = torch.randint(VOCAB_LO, vocab, (p + r,), generator=gen)
        mask[i, PROMPT - p: PROMPT + r] = 1
    resp_mask = mask[:, PROMPT:].clone()
    returns = torch.randn(rows, RESPONSE, generator=gen) * resp_mask
    data = DataProto.from_dict({
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, PROMPT:].clone(), "response_mask": resp_mask,
        "advantages": torch.randn(rows, RESPONSE, generator=gen) * resp_mask,
        "old_log_probs": -torch.rand(rows, RESPONSE, generator=gen) * 4 * resp_mask,
        "returns": returns, "values": returns + 0.2 * torch.randn(rows, RESPONSE, generator=gen)})
    data.meta_info.update(temperature=1.0, calculate_entropy=True)
    return data, resp_mask.sum(-1)


def _max_diff(a, b) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _rank_job(rank, world, ckpt, args):
    import torch.distributed as dist

    from hybridflow.algorithms.objectives import ActorObjective, make_actor_loss_fn, make_critic_loss_fn
    from workers.engines.config import EngineConfig
    from workers.engines.megatron import MegatronEngine
    from workers.engines.megatron_fused import fused_train_batch
    from workers.engines.megatron_pipeline import WaitClock

    def cfg(reverse=False):
        return EngineConfig(strategy="megatron", tp=1, pp=2, param_dtype=args["dtype"], lr=1e-5,
                            micro_batch_size_per_gpu=args["micro"], reverse_pipeline=reverse, seed=0)

    seq = (MegatronEngine(cfg(), ckpt, "actor"), MegatronEngine(cfg(), ckpt, "critic"))
    fused = (MegatronEngine(cfg(), ckpt, "actor"), MegatronEngine(cfg(reverse=True), ckpt, "critic"))
    data, _ = longtail_batch(args["rows"], seq[0].dims.vocab_size, seed=args["seed"])
    objective = ActorObjective(skip_zero_advantage=False)  # every row computed: equal work each step
    actor_loss, critic_loss = make_actor_loss_fn(objective), make_critic_loss_fn(0.5)

    def run_seq():
        seq[0].train_batch(data, actor_loss)
        seq[1].train_batch(data, critic_loss)

    def run_fused():
        fused_train_batch(fused[0], data, actor_loss, fused[1], data, critic_loss, prefer=args["prefer"])

    times, waits = {"sequential": [], "fused": []}, {"sequential": [], "fused": []}
    for rep in range(args["repeats"] + 1):
        order = (("sequential", run_seq), ("fused", run_fused))
        for name, fn in (order if rep % 2 == 0 else order[::-1]):
            dist.barrier()
            WaitClock.total_s = 0.0
            t0 = time.perf_counter()
            fn()
            waits[name].append(WaitClock.total_s)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    diffs = []
    for a, b in zip(seq, fused):
        wa = {n: t.clone() for n, t in a.export_hf_weights()}
        wb = {n: t.clone() for n, t in b.export_hf_weights()}
        diffs.append(_max_diff(wa, wb))
    return pickle.dumps({"times": times, "waits": waits, "max_abs_weight_diff": max(diffs)})


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=4, help="timed repetitions after one warm-up")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--micro", type=int, default=4, help="micro_batch_size_per_gpu")
    p.add_argument("--dtype", default="auto", help="fp32 | bf16 | auto (what param_dtype=auto picks here)")
    p.add_argument("--prefer", default="feed", help="fused driver's preference: feed | actor | critic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "hf_fusion_bench"))
    return p.parse_args(argv)


def measure(argv=None) -> dict:
    from hybridflow.device import auto_param_dtype
    from hybridflow.tiny import make_tiny_checkpoint
    from tests.distributed import run_distributed

    args = parse_args(argv)
    dtype = args.dtype if args.dtype != "auto" else auto_param_dtype(False)[0]
    ckpt = os.path.join(args.work_dir, "qwen2-medium")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        make_tiny_checkpoint(ckpt, "qwen2", seed=0, **SIZES["medium"])
    job = dict(dtype=dtype, micro=args.micro, rows=args.rows, repeats=args.repeats, prefer=args.prefer, seed=args.seed)
    ranks = [pickle.loads(r) for r in run_distributed(_rank_job, 2, ckpt, job, timeout_s=3600)]
    # an update ends when its slower rank does (the barrier after it): rank 0's clock sees that
    times = {k: v[1:] for k, v in ranks[0]["times"].items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    _, lengths = longtail_batch(args.rows, 100, seed=args.seed)
    flags = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
    return {
        "bench": "fusion_update",
        "layout": "megatron tp=1 pp=2, 2 processes, 1 thread each",
        "model": "e2e medium (qwen2, hidden 512, 8 layers)", "dtype": dtype,
        "rows": args.rows, "micro_batch_size_per_gpu": args.micro, "micro_batches": -(-args.rows // args.micro),
        "response_tokens": {"p50": float(lengths.float().median()), "max": int(lengths.max()),
                            "mean": round(float(lengths.float().mean()), 1)},
        "prefer": args.prefer, "repeats": args.repeats,
        "median_s": med, "all_s": times,
        "ratio_fused_over_sequential": med["fused"] / med["sequential"],
        "median_wait_s_per_rank": {k: [round(statistics.median(r["waits"][k][1:]), 3) for r in ranks]
                                   for k in ("sequential", "fused")},
        "max_abs_weight_diff": max(r["max_abs_weight_diff"] for r in ranks),
        "cpu_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma"}),
        "goal": "ratio_fused_over_sequential <= 0.85",
    }


def main(argv=None) -> int:
    print(json.dumps(measure(argv), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
