"""Without /dev/shm the reshard falls back to point-to-point (auto) or says why (shm).

The shared-memory path itself is exercised by tests/resharding/test_transfer.py (both transports)."""
from __future__ import annotations

import pytest

from tests.distributed import run_distributed


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
