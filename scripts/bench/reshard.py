"""Benchmark the train -> generate weight transition: 3D-HybridEngine plan vs a naive sync.

Naive baseline: every Megatron tensor is gathered to rank 0 and broadcast, full size, to all
ranks (what a controller-side "export then load" does). The resharder moves only the regions
each rank's vLLM shard reads. Both run on synthetic weights sharded as the Megatron table says,
on one machine (gloo on CPU, nccl on GPUs), and hand each tensor to a no-op consumer.

    python scripts/bench/reshard.py --layouts 1,2,1,2 1,2,1,1 2,1,1,1 1,2,2,2 --out reshard.json

Each layout is pp,tp,dp,tp_g. Prints and writes JSON: per layout, per rank, seconds and bytes
received/sent for both methods, and the largest bucket of the resharder (its extra memory).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from resharding.layout import GenLayout, TrainLayout  # noqa: E402
from resharding.plan import plan_from_param_specs  # noqa: E402
from resharding.transfer import Resharder, drain  # noqa: E402


def model_config(args) -> SimpleNamespace:
    return SimpleNamespace(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=args.hidden,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                           intermediate_size=args.intermediate, vocab_size=args.vocab, rms_norm_eps=1e-6,
                           tie_word_embeddings=False)


def local_shards(specs, seed: int, device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape_per_rank, generator=g).to(device) for s in specs}


def naive_sync(train: TrainLayout, stage_specs, local, device) -> dict:
    """Gather each Megatron tensor's TP shards to rank 0, then broadcast the full tensor."""
    rank, stats = dist.get_rank(), {"bytes_received": 0, "bytes_sent": 0}
    start = time.perf_counter()
    for stage, specs in enumerate(stage_specs):
        for spec in specs:
            shards = []
            for t in range(train.tp if spec.split_dim is not None else 1):
                holder = train.rank(stage, t, 0)
                if holder == 0:
                    if rank == 0:
                        shards.append(local[spec.name])
                elif rank == 0:
                    buf = torch.empty(spec.shape_per_rank, device=device)
                    dist.recv(buf, src=holder)
                    stats["bytes_received"] += buf.numel() * buf.element_size()
                    shards.append(buf)
                elif rank == holder:
                    dist.send(local[spec.name].contiguous(), dst=0)
                    stats["bytes_sent"] += local[spec.name].numel() * 4
            shape = list(spec.shape_per_rank)
            if spec.split_dim is not None:
                shape[spec.split_dim] *= train.tp
            full = torch.cat(shards, spec.split_dim) if rank == 0 and spec.split_dim is not None else (
                shards[0] if rank == 0 else torch.empty(shape, device=device))
            dist.broadcast(full, src=0)
            nbytes = full.numel() * full.element_size()
            stats["bytes_sent" if rank == 0 else "bytes_received"] += nbytes * (train.world - 1 if rank == 0 else 1)
    stats["seconds"] = time.perf_counter() - start
    return stats


def _worker(rank, world, port, layout, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from hybridflow import device as hf_device
    from workers.models.layout import param_specs

    hf_device.init_distributed(timeout_s=600)
    dev = hf_device.torch_device(rank)
    pp, tp, dp, tp_g = layout
    train, gen = TrainLayout(pp, tp, dp), GenLayout(tp_g, world)
    cfg = model_config(args)
    stage_specs = [param_specs(cfg, tp, pp, s) for s in range(pp)]
    pp_rank, tp_rank, _ = train.coords(rank)
    local = local_shards(stage_specs[pp_rank], seed=tp_rank, device=dev)
    plan = plan_from_param_specs(param_specs, cfg, train, gen)
    resharder = Resharder(plan, bucket_bytes=args.bucket_mb << 20)
    out = {}
    for name, run in (("naive", lambda: naive_sync(train, stage_specs, local, dev)),
                      ("hybrid_engine", lambda: (drain(resharder.stream(local)), vars(resharder.stats))[1])):
        dist.barrier()
        best = None
        for _ in range(args.repeats):
            stats = dict(run())
            best = stats if best is None or stats["seconds"] < best["seconds"] else best
        out[name] = best
    out["model_bytes"] = plan.model_elements() * 4
    queue.put((rank, out))
    dist.destroy_process_group()


def bench_layout(layout, args) -> list[dict]:
    world = layout[0] * layout[1] * layout[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, layout, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1200) for _ in procs)
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", nargs="+", default=["1,2,1,2", "1,2,1,1", "2,1,1,1", "1,2,2,2"],
                    help="pp,tp,dp,tp_g per layout")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--bucket-mb", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    report = {"model": vars(model_config(args)), "bucket_mb": args.bucket_mb, "layouts": []}
    for text in args.layouts:
        layout = tuple(int(x) for x in text.split(","))
        if len(layout) != 4:
            raise SystemExit(f"--layouts entry {text!r} must be pp,tp,dp,tp_g (e.g. 1,2,1,2)")
        per_rank = bench_layout(layout, args)
        report["layouts"].append({"pp_tp_dp_tpg": layout, "per_rank": per_rank})
        for method in ("naive", "hybrid_engine"):
            worst = max(r[method]["seconds"] for r in per_rank)
            recv = max(r[method]["bytes_received"] for r in per_rank)
            print(f"{layout} {method:14s} transition {worst * 1e3:8.1f} ms  max bytes received/rank "
                  f"{recv / 2**20:8.2f} MiB  (model {per_rank[0]['model_bytes'] / 2**20:.2f} MiB)")
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
