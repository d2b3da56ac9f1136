"""Bucketed transfer on real gloo worlds: every rank's vLLM region equals the reference tensor."""
from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed

C, S = "consecutive", "strided"  # vLLM's generation groups, the paper's
LAYOUTS_2 = [(1, 2, 1, 2, C), (1, 2, 1, 1, C), (2, 1, 1, 1, C), (1, 1, 2, 1, C)]
LAYOUTS_4 = [(1, 4, 1, 2, C), (1, 4, 1, 4, C), (2, 2, 1, 1, C), (2, 2, 1, 2, C), (1, 2, 2, 1, C), (2, 1, 2, 1, C),
             (1, 4, 1, 2, S), (2, 2, 1, 2, S)]


def _reshard_layouts(rank, world, layouts, bucket_bytes, transport):
    from resharding.layout import GenLayout, TrainLayout
    from resharding.plan import build_plan
    from resharding.transfer import Resharder
    from tests.resharding.megatron_table import full_table, megatron_shards, reference_weights, tiny_dims

    results = []
    for pp, tp, dp, tp_g, order in layouts:
        dims = tiny_dims(heads=4, kv_heads=4, head_dim=2, hidden=8, intermediate=8, vocab=24)
        plan = build_plan(TrainLayout(pp, tp, dp), GenLayout(tp_g, world, order),
                          full_table(dims, 2, tp, pp, tied=(pp == 2)), dims)
        full = reference_weights(plan, seed=7)  # the same on every rank: the test's ground truth
        local = megatron_shards(plan, full, rank)
        resharder = Resharder(plan, bucket_bytes=bucket_bytes, transport=transport)
        seen, wrong = [], []
        index = {t.hf_name: i for i, t in enumerate(plan.tensors)}
        for name, tensor in resharder.stream(local):
            dim, start, stop = plan.needed[(index[name], rank)]
            got, ref = (tensor, full[name]) if dim is None else (
                tensor.narrow(dim, start, stop - start), full[name].narrow(dim, start, stop - start))
            if not torch.equal(got, ref):
                wrong.append(name)
            seen.append(name)
        expected = plan.elements(rank)
        results.append(dict(layout=(pp, tp, dp, tp_g), wrong=wrong, complete=sorted(seen) == sorted(full) and len(seen) == len(full),
                            shared=resharder.uses_shared_memory,
                            moves=any(p.src != p.dst for p in plan.pieces),
                            stats=vars(resharder.stats), expected_received=4 * expected["received"],
                            expected_sent=4 * expected["sent"], model_bytes=4 * plan.model_elements()))
    return results


def _fsdp_stream(rank, world, transport):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from resharding.fsdp_stream import FSDPWeightStream

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    full = {"model.embed_tokens.weight": torch.randn(10, 4, generator=g),  # uneven: 5 rows per rank
            "model.norm.weight": torch.randn(4, generator=g), "lm_head.weight": torch.randn(7, 4, generator=g)}
    shards = [(n, distribute_tensor(t, mesh, [Shard(0)])) for n, t in full.items()]
    weights = FSDPWeightStream(bucket_bytes=100, transport=transport)
    runs = []
    for step in range(2):  # the second sync reuses the shared buffers and must see new values
        if step:
            for _, t in shards:
                t.to_local().mul_(-2)
            full = {n: t * -2 for n, t in full.items()}
        out = list(weights.stream(shards))
        runs.append(([n for n, _ in out], all(torch.equal(t, full[n]) for n, t in out), vars(weights.stats)))
    import os
    # the buffers stay mapped for the next sync, but no name is left in /dev/shm
    left = [p for p in (weights._host.paths if weights._host else []) if os.path.exists(p)]
    return runs, weights.uses_shared_memory, left


@pytest.mark.slow
@pytest.mark.parametrize("world,layouts,transport", [(2, LAYOUTS_2, "shm"), (4, LAYOUTS_4, "shm"),
                                                     (4, LAYOUTS_4, "p2p")])
def test_bucketed_reshard_delivers_vllm_regions(world, layouts, transport):
    """Both transports: shared buffers (what CPU ranks of one host use) and batched isend/irecv
    (what GPUs and ranks of several hosts use) deliver the same regions and count the same bytes."""
    per_rank = run_distributed(_reshard_layouts, world, layouts, 512, transport, timeout_s=540)
    for rank, results in enumerate(per_rank):
        for r in results:
            assert r["shared"] == (transport == "shm" and r["moves"]), (rank, r)
            assert r["wrong"] == [] and r["complete"], (rank, r)
            assert r["stats"]["bytes_received"] == r["expected_received"], (rank, r)
            assert r["stats"]["bytes_sent"] == r["expected_sent"], (rank, r)
            assert r["stats"]["buckets"] > 1, "a 512-byte bucket cannot hold the model"
            assert r["stats"]["peak_bucket_bytes"] < r["model_bytes"]
            pp, tp, dp, tp_g = r["layout"]
            if tp > 1 or pp > 1:
                assert r["stats"]["bytes_received"] < r["model_bytes"]
    # what goes out equals what comes in, across the world
    for i in range(len(layouts)):
        assert sum(per_rank[k][i]["stats"]["bytes_sent"] for k in range(world)) == \
            sum(per_rank[k][i]["stats"]["bytes_received"] for k in range(world))


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "p2p"])
def test_fsdp_stream_yields_full_tensors_per_bucket(transport):
    for rank, (runs, shared, left) in enumerate(run_distributed(_fsdp_stream, 2, transport, timeout_s=540)):
        assert shared == (transport == "shm") and left == []
        for names, equal, stats in runs:
            assert names == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
            assert equal
            assert stats["buckets"] == 3  # 160 B, then 16 B (+112 B would pass 100 B), then 112 B
            # rank 0 holds 5+2+4 of the 10+4+7 rows, rank 1 holds 5+2+3 (torch.chunk sharding)
            held = [20 + 2 + 16, 20 + 2 + 12][rank]
            assert stats["bytes_received"] == (40 + 4 + 28 - held) * 4
