"""Benchmark getting new weights into vLLM on CPU: live weights vs vLLM's full in-place reload.

Two engines on the same checkpoint in one process (a 1-rank gloo world, one thread, like one
worker): ``rollout.cpu_live_weights=true`` (plain weights kept beside the packed kernels; a sync
is vLLM's ``load_weights`` plus a repack) and ``false`` (vLLM's ``reload_weights``: meta round
trip, load, repack). Each gets the same HF state dict, and generates the same batch, alternately
so that load drift hits both. The generation column shows that keeping plain weights costs
generation nothing; the extra RAM is the plain weights' size, reported too.

    python scripts/bench/weight_sync.py --size demo
    python scripts/bench/weight_sync.py --size medium --response-len 16

Prints JSON: medians of sync seconds and generation seconds per mode, and the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from e2e import SIZES  # noqa: E402  (this folder is sys.path[0] when run as a script)
from rollout import prompts_batch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="demo", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=64, help="sequences generated per round")
    ap.add_argument("--response-len", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a worker has 1)")
    args = ap.parse_args()

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29612"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from safetensors.torch import load_file

    from hybridflow.device import init_distributed
    from hybridflow.tiny import make_tiny_checkpoint
    from workers.rollout.base import RolloutConfig
    from workers.rollout.vllm_rollout import VLLMRollout

    init_distributed()
    torch.set_num_threads(args.threads)
    path = make_tiny_checkpoint(tempfile.mkdtemp(prefix="bench_sync_"), "qwen2", seed=0,
                                **SIZES[args.size])
    weights = load_file(f"{path}/model.safetensors")
    engines = {}
    for mode, live in (("live", True), ("reload", False)):
        config = RolloutConfig(prompt_length=16, response_length=args.response_len,
                               kv_cache_gib=0.5, cpu_live_weights=live)
        engines[mode] = VLLMRollout(config, path)
        assert (engines[mode].why_full_reload is None) == live, engines[mode].why_full_reload
    prompts = prompts_batch(args.batch, 16, 3, 30, engines["live"].pad_token_id, seed=0)

    def timed(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    times = {f"{what}_{mode}": [] for what in ("sync", "gen") for mode in engines}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        order = list(engines) if round_ % 2 else list(reversed(engines))
        for mode in order:
            sync = timed(lambda: engines[mode].update_weights(iter(weights.items())))
            gen = timed(lambda: engines[mode].generate_sequences(prompts))
            if round_:
                times[f"sync_{mode}"].append(sync)
                times[f"gen_{mode}"].append(gen)
    med = {k: round(statistics.median(v), 5) for k, v in times.items()}
    result = {
        "median_s": med,
        "sync_reload_over_live": round(med["sync_reload"] / med["sync_live"], 2),
        "gen_live_over_reload": round(med["gen_live"] / med["gen_reload"], 3),
        "plain_weight_megabytes": round(sum(t.numel() * t.element_size() for t in weights.values())
                                        / 2**20, 1),
        "settings": vars(args),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
