"""Bucketed transfer on real gloo worlds: every rank's vLLM region equals the reference tensor."""
from __future__ import annotations

import os

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

    zero_copy = transport != "shm-buffers"  # buffers: the fallback when /dev/shm cannot hold the parameters
    transport = "shm" if transport == "shm-buffers" else transport
    results = []
    for pp, tp, dp, tp_g, order in layouts:
        dims = tiny_dims(heads=4, kv_heads=4, head_dim=2, hidden=8, intermediate=8, vocab=24)
        plan = build_plan(TrainLayout(pp, tp, dp), GenLayout(tp_g, world, order),
                          full_table(dims, 2, tp, pp, tied=(pp == 2)), dims)
        full = reference_weights(plan, seed=7)  # the same on every rank: the test's ground truth
        local = megatron_shards(plan, full, rank)
        resharder = Resharder(plan, bucket_bytes=bucket_bytes, transport=transport, zero_copy=zero_copy)
        index = {t.hf_name: i for i, t in enumerate(plan.tensors)}
        runs = []
        for step in range(2):
            if step:  # an optimizer step in place; rank 0 also re-points one tensor (as an offload would)
                if rank == 0:
                    first = next(iter(local.values()))
                    first.data = first.data.clone()
                for t in local.values():
                    t.mul_(-2)
                full = {n: t * -2 for n, t in full.items()}
            seen, wrong = [], []
            for name, tensor in resharder.stream(local):
                dim, start, stop = plan.needed[(index[name], rank)]
                got, ref = (tensor, full[name]) if dim is None else (
                    tensor.narrow(dim, start, stop - start), full[name].narrow(dim, start, stop - start))
                if not torch.equal(got, ref):
                    wrong.append(name)
                seen.append(name)
            runs.append((wrong, sorted(seen) == sorted(full) and len(seen) == len(full)))
        expected = plan.elements(rank)
        results.append(dict(layout=(pp, tp, dp, tp_g), runs=runs,
                            shared=resharder.uses_shared_memory, zero_copy=resharder.reads_peer_parameters,
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
@pytest.mark.parametrize("world,layouts,transport", [(2, LAYOUTS_2, "shm"), (2, LAYOUTS_2, "shm-buffers"),
                                                     (4, LAYOUTS_4, "shm"), (4, LAYOUTS_4, "p2p")])
def test_bucketed_reshard_delivers_vllm_regions(world, layouts, transport):
    """Every transport delivers the same regions and counts the same bytes: zero-copy reads of
    the owners' parameters (CPU ranks of one host), bucket-sized shared buffers (its fallback),
    batched isend/irecv (GPUs, several hosts). The second stream of each layout follows an
    in-place update, with one tensor re-pointed on rank 0, and must see the new values."""
    per_rank = run_distributed(_reshard_layouts, world, layouts, 512, transport, timeout_s=540)
    for rank, results in enumerate(per_rank):
        for r in results:
            assert r["shared"] == (transport != "p2p" and r["moves"]), (rank, r)
            assert r["zero_copy"] == (transport == "shm" and r["moves"]), (rank, r)
            for wrong, complete in r["runs"]:
                assert wrong == [] and complete, (rank, r)
            assert r["stats"]["bytes_received"] == r["expected_received"], (rank, r)
            assert r["stats"]["bytes_sent"] == r["expected_sent"], (rank, r)
            assert r["stats"]["buckets"] > 1, "a 512-byte bucket cannot hold the model"
            assert r["stats"]["peak_bucket_bytes"] < r["model_bytes"]
            if r["zero_copy"]:
                assert not [f for f in os.listdir("/dev/shm") if f.startswith("hybridflow-params-")]
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
