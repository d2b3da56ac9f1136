"""Shared-memory rounds between real processes: data arrives, names are gone, no /dev/shm -> p2p."""
from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_distributed


def _rounds(rank, world, shm_dir):
    import torch.distributed as dist

    from resharding import host_exchange
    from resharding.host_exchange import HostExchange

    if shm_dir is not None:
        host_exchange.SHM_DIR = shm_dir
    # every rank sends (rank+1)*10 floats to every other rank
    capacity = {(s, d): (s + 1) * 10 * 4 for s in range(world) for d in range(world) if s != d}
    ex = HostExchange.open(capacity, None)
    if ex is None:
        return {"open": False}
    dist.barrier()  # each rank unlinks its own names when open() returns
    left = [n for n in os.listdir(host_exchange.SHM_DIR) if n.startswith("hybridflow-reshard-")]
    got = []
    for round_ in range(3):  # buffers are reused: each round must see its own values
        for d in range(world):
            if d != rank:
                ex.send_view(d, (rank + 1) * 10, torch.float32).copy_(
                    torch.full(((rank + 1) * 10,), 100.0 * round_ + rank))
        ex.fence()
        got.append({s: ex.recv_view(s, (s + 1) * 10, torch.float32).tolist() for s in range(world) if s != rank})
        ex.fence()
    dist.barrier()
    return {"open": True, "left": left, "got": got}


@pytest.mark.slow
def test_rounds_deliver_each_senders_values_and_leave_no_files():
    world = 3
    for rank, r in enumerate(run_distributed(_rounds, world, None)):
        assert r["open"] and r["left"] == [], r.get("left")
        for round_, got in enumerate(r["got"]):
            assert got == {s: [100.0 * round_ + s] * ((s + 1) * 10) for s in range(world) if s != rank}


def _reshard_without_shm(rank, world, transport):
    from resharding import host_exchange
    from resharding.layout import GenLayout, TrainLayout
    from resharding.plan import build_plan
    from resharding.transfer import Resharder, drain
    from tests.resharding.megatron_table import full_table, megatron_shards, reference_weights, tiny_dims

    host_exchange.SHM_DIR = "/nonexistent-shm-dir"
    dims = tiny_dims(heads=4, kv_heads=4, head_dim=2, hidden=8, intermediate=8, vocab=24)
    plan = build_plan(TrainLayout(1, 2, 1), GenLayout(1, world), full_table(dims, 2, 2, 1, tied=False), dims)
    local = megatron_shards(plan, reference_weights(plan, seed=7), rank)
    resharder = Resharder(plan, transport=transport)
    try:
        drain(resharder.stream(local))
    except RuntimeError as e:
        return str(e)
    return resharder.uses_shared_memory, resharder.stats.bytes_received


@pytest.mark.slow
def test_auto_falls_back_to_p2p_and_shm_says_why():
    # no rank can create its buffers: open() gives None on every rank, none is left mapped
    for shared, received in run_distributed(_reshard_without_shm, 2, "auto"):
        assert shared is False and received > 0
    for message in run_distributed(_reshard_without_shm, 2, "shm"):
        assert "shared memory cannot serve" in message and "transport='auto'" in message
