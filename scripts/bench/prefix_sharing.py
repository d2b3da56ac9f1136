"""Benchmark one forward per distinct prompt (``share_prompt_prefix``) in the FSDP and Megatron engines.

Two gloo ranks x 1 thread run the engine's ``train_batch`` (forward + backward + AdamW) and
``compute_log_prob`` on GRPO-shaped rows (``--prompts`` prompts x ``--samples`` samples, the
samples of a prompt on consecutive rows, as the trainer lays them out), with sharing on and off,
interleaved over rounds so load drift hits both alike. Prints JSON: seconds per call (median of
per-round bests) and the shared/per-row ratio for each parameter layout.

    .venv/bin/python scripts/bench/prefix_sharing.py                      # e2e's medium model
    .venv/bin/python scripts/bench/prefix_sharing.py --layouts 1 --rounds 5
    .venv/bin/python scripts/bench/prefix_sharing.py --layouts megatron-dp2,megatron-tp2,megatron-pp2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hybridflow.ports import free_rendezvous_port  # noqa: E402


def grouped_batch(prompts: int, samples: int, prompt_len: int, resp_len: int, vocab: int, seed: int):
    """Left-padded prompts of random length, each repeated ``samples`` times with its own
    right-padded response (random length; the first row uses the whole response)."""
    import torch

    from hybridflow.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    rows = prompts * samples
    ids = torch.zeros(rows, prompt_len + resp_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for p in range(prompts):
        n = int(torch.randint(prompt_len // 2, prompt_len + 1, (1,), generator=g))
        prompt = torch.randint(3, vocab, (n,), generator=g)
        for s in range(samples):
            row = p * samples + s
            r = resp_len if row == 0 else int(torch.randint(1, resp_len + 1, (1,), generator=g))
            ids[row, prompt_len - n:prompt_len] = prompt
            ids[row, prompt_len:prompt_len + r] = torch.randint(3, vocab, (r,), generator=g)
            mask[row, prompt_len - n:prompt_len + r] = 1
    return DataProto.from_dict({
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, prompt_len:].clone(), "response_mask": mask[:, prompt_len:].clone(),
        "advantages": torch.randn(rows, resp_len, generator=g)})


def pg_loss(outputs, micro):
    from workers.engines.base import mini_batch_token_mean

    loss = mini_batch_token_mean(-micro.batch["advantages"] * outputs["log_probs"],
                                 micro.batch["response_mask"].float(), micro)
    return loss, {}


def _rank(rank, world, port, args, ckpt, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    from hybridflow.device import init_distributed
    from workers.engines.config import EngineConfig
    from workers.engines.fsdp import FSDPEngine

    def make_engine(layout: str, share: bool):
        if layout.startswith("megatron-"):
            from megatron.core import parallel_state as ps

            from workers.engines.megatron import MegatronEngine

            ps.destroy_model_parallel()
            kind = layout.removeprefix("megatron-")
            return MegatronEngine(EngineConfig(strategy="megatron", lr=1e-5, micro_batch_size_per_gpu=args.micro_batch,
                                               tp=2 if kind == "tp2" else 1, pp=2 if kind == "pp2" else 1,
                                               share_prompt_prefix=share), ckpt, "actor")
        return FSDPEngine(EngineConfig(lr=1e-5, micro_batch_size_per_gpu=args.micro_batch,
                                       fsdp_size=int(layout), share_prompt_prefix=share), ckpt, "actor")

    init_distributed(timeout_s=300)
    data = grouped_batch(args.prompts, args.samples, args.prompt_len, args.response_len, 60, seed=0)
    results = {}
    for layout in args.layouts:
        for rnd in range(args.rounds):
            for share in ((False, True) if rnd % 2 == 0 else (True, False)):
                engine = make_engine(layout, share)
                dp_rank, dp_size = getattr(engine, "dp_rank", rank), getattr(engine, "dp_size", world)
                per_rank = len(data) // dp_size  # TP and PP peers hold the same rows
                mine = data[dp_rank * per_rank:(dp_rank + 1) * per_rank]
                engine.train_batch(mine, pg_loss)  # warm-up
                best = {"train_batch": float("inf"), "compute_log_prob": float("inf")}
                for _ in range(args.steps):
                    start = time.perf_counter()
                    engine.train_batch(mine, pg_loss)
                    best["train_batch"] = min(best["train_batch"], time.perf_counter() - start)
                    start = time.perf_counter()
                    engine.compute_log_prob(mine, 1.0)
                    best["compute_log_prob"] = min(best["compute_log_prob"], time.perf_counter() - start)
                results.setdefault((layout, share), []).append(best)
                del engine
    queue.put((rank, results))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="medium", help="a model size of e2e.py")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--response-len", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=64, help="rows per forward/backward per rank")
    p.add_argument("--layouts", default="1,-1", help="FSDP fsdp_size values (1 replicated, -1 sharded) and/or "
                   "megatron-dp2, megatron-tp2, megatron-pp2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="timed calls per engine per round (best kept)")
    args = p.parse_args(argv)
    args.layouts = args.layouts.split(",")

    import torch.multiprocessing as mp

    from e2e import SIZES
    from hybridflow.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(os.path.join(tmp, "model"), "qwen2", seed=0, **SIZES[args.size])
        port = free_rendezvous_port("127.0.0.1")
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, 2, port, args, ckpt, queue)) for r in range(2)]
        for proc in procs:
            proc.start()
        by_rank = dict(queue.get(timeout=3600) for _ in procs)
        for proc in procs:
            proc.join()
    report = {"setting": {k: v for k, v in vars(args).items()}, "load_avg_1m": os.getloadavg()[0], "results": {}}
    for layout in args.layouts:
        entry = {}
        for what in ("train_batch", "compute_log_prob"):
            # a call takes as long as its slowest rank; the median over rounds of that
            secs = {share: statistics.median(max(by_rank[r][(layout, share)][i][what] for r in by_rank)
                                             for i in range(args.rounds)) for share in (False, True)}
            entry[what] = {"per_row_s": round(secs[False], 4), "shared_s": round(secs[True], 4),
                           "ratio": round(secs[True] / secs[False], 3)}
        name = layout if layout.startswith("megatron-") else ("replicated" if layout == "1" else f"fsdp_size={layout}")
        report["results"][name] = entry
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
