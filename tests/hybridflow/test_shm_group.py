"""Shared-memory process groups give the same results as gloo, for every collective the engines
use on them, and leave nothing in /dev/shm."""
from __future__ import annotations

import glob

import pytest

from tests.distributed import run_distributed


def _collectives(rank, world):
    import os

    import torch
    import torch.distributed as dist

    from hybridflow import shm_group

    os.environ[shm_group.ENV_SWITCH] = "1"
    group = shm_group.new_group(range(world))
    left = sorted(glob.glob("/dev/shm/hfshm-*"))
    gen = torch.Generator().manual_seed(rank)
    out = {"shared": isinstance(group, shm_group.SharedMemoryGroup) and group.uses_shared_memory,
           "group_rank": dist.get_rank(group),
           "files_left": left}
    for dtype in (torch.float32, torch.bfloat16):
        # larger than vLLM's per-thread buffer, so the kernel works in several chunks
        x = torch.randn(3_000_001, generator=gen).to(dtype)
        ref = x.clone()
        dist.all_reduce(x, group=group)
        dist.all_reduce(ref)  # the world group: gloo
        out[f"sum_{dtype}"] = (x.float() - ref.float()).abs().max().item()
    m = torch.tensor([float(rank), -float(rank)])
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # not a SUM: gloo
    out["max"] = m.tolist()
    ints = torch.tensor([rank + 1])
    dist.all_reduce(ints, group=group)  # not a float: gloo
    out["int_sum"] = ints.item()
    strided = torch.arange(6.0).view(2, 3).t() * (rank + 1)  # not contiguous: gloo
    dist.all_reduce(strided, group=group)
    out["strided"] = strided.tolist()
    work = dist.all_reduce(torch.ones(4), group=group, async_op=True)
    work.wait()
    flat = torch.zeros(2 * world)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)), group=group)
    out["all_gather"] = flat.tolist()
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=world - 1, group=group)
    out["broadcast"] = b.tolist()
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank}, group=group)
    out["objects"] = objects
    dist.barrier(group=group)
    # the same group through megatron-core's tensor-parallel region, forward and backward
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    leaf = torch.ones(3, requires_grad=True)
    reduced = reduce_from_tensor_model_parallel_region(leaf * (rank + 1), group=group)
    reduced.sum().backward()
    out["mapping"] = reduced.tolist(), leaf.grad.tolist()
    return out


@pytest.mark.slow
def test_shared_memory_group_matches_gloo():
    """Where this CPU lacks vLLM's kernels (AVX2 only, or HYBRIDFLOW_CPU_ISA=avx2) the group is
    plain gloo and the same results must hold."""
    from hybridflow import shm_group

    shared = shm_group._kernels_available()
    results = run_distributed(_collectives, 2)
    for rank, r in enumerate(results):
        assert r["shared"] is shared
        assert r["group_rank"] == rank
        assert r["files_left"] == []  # names dropped once every rank mapped them
        assert r["sum_torch.float32"] < 1e-5
        assert r["sum_torch.bfloat16"] < 0.07  # bf16 rounding of different summation orders
        assert r["max"] == [1.0, 0.0]
        assert r["int_sum"] == 3
        assert r["strided"] == [[0.0, 9.0], [3.0, 12.0], [6.0, 15.0]]
        assert r["all_gather"] == [0.0, 0.0, 1.0, 1.0]
        assert r["broadcast"] == [1.0, 1.0, 1.0]
        assert r["objects"] == [{"rank": 0}, {"rank": 1}]
        assert r["mapping"] == ([3.0, 3.0, 3.0], [float(rank + 1)] * 3)
    assert not glob.glob("/dev/shm/hfshm-*")


@pytest.mark.parametrize("value,wanted", [(None, False), ("0", False), ("1", True)])
def test_off_unless_asked_for(monkeypatch, value, wanted):
    """The kernel spins while it waits, so it is opt-in (hybridflow/shm_group.py docstring)."""
    from hybridflow import shm_group

    monkeypatch.setenv("HYBRIDFLOW_DEVICE", "cpu")
    if value is None:
        monkeypatch.delenv(shm_group.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(shm_group.ENV_SWITCH, value)
    # asked for, it still needs vLLM's kernels (absent on AVX2-only CPUs)
    assert shm_group.enabled() is (wanted and shm_group._kernels_available())
    monkeypatch.setenv("HYBRIDFLOW_DEVICE", "cuda")
    assert shm_group.enabled() is False  # NCCL serves GPU ranks


def test_an_avx2_cpu_gets_gloo_even_when_asked_for(monkeypatch):
    """HYBRIDFLOW_CPU_ISA=avx2 answers as an AVX2-only CPU: no shared-memory kernels."""
    from hybridflow import cpu_isa, shm_group

    monkeypatch.setenv("HYBRIDFLOW_DEVICE", "cpu")
    monkeypatch.setenv(shm_group.ENV_SWITCH, "1")
    monkeypatch.setenv(cpu_isa.ENV, "avx2")
    assert shm_group._kernels_available() is False and shm_group.enabled() is False
    monkeypatch.setenv(cpu_isa.ENV, "avx3")
    with pytest.raises(ValueError, match="HYBRIDFLOW_CPU_ISA='avx3': use avx2"):
        shm_group.enabled()


@pytest.mark.parametrize("value,ranks,threads,wanted", [
    (None, 2, 1, True), ("1", 2, 1, True), ("0", 2, 1, False),  # gradients: on unless turned off
    (None, 1, 1, False),  # nothing to reduce
    (None, 2, 2, False), (None, 4, 1, False),  # more threads than this host's 2 cores: a spin would take a peer's
])
def test_gradients_through_shared_memory_by_default_where_each_rank_has_its_cores(monkeypatch, value, ranks,
                                                                                  threads, wanted):
    import torch

    from hybridflow import auto_cpu_layout, shm_group

    monkeypatch.setenv("HYBRIDFLOW_DEVICE", "cpu")
    if value is None:
        monkeypatch.delenv(shm_group.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(shm_group.ENV_SWITCH, value)
    monkeypatch.setattr(auto_cpu_layout, "host_cores", lambda num_cpus: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert shm_group.gradients_enabled(ranks) is (wanted and shm_group._kernels_available())
        monkeypatch.setenv("HYBRIDFLOW_DEVICE", "cuda")
        assert shm_group.gradients_enabled(ranks) is False
    finally:
        torch.set_num_threads(before)


def _gradient_groups(rank, world):
    import os

    from hybridflow import shm_group

    os.environ.pop(shm_group.ENV_SWITCH, None)
    both = shm_group.gradient_group(range(world))
    if rank == 1:  # one rank turned off (or a host without the kernels): neither may build the group
        os.environ[shm_group.ENV_SWITCH] = "0"
    split = shm_group.gradient_group(range(world))
    os.environ.pop(shm_group.ENV_SWITCH, None)
    return both is not None, split is None


@pytest.mark.slow
def test_ranks_decide_the_gradient_group_together():
    """One rank that may not use shared memory keeps all on gloo, and nobody waits in a group
    the other never builds."""
    from hybridflow import shm_group

    results = run_distributed(_gradient_groups, 2, timeout_s=120)
    assert [split for _, split in results] == [True, True]
    assert [both for both, _ in results] == [shm_group._kernels_available()] * 2
