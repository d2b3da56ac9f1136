"""Process groups whose all-reduces go through shared memory when every rank is on one CPU host.

gloo, torch's CPU backend, has no shared-memory transport: two processes of one machine
all-reduce over TCP loopback. On this 2-core VM that measured 9.6 ms for 6 MB (a tensor-parallel
activation) and 190 ms for 100 MB (the gradients of a 25M-parameter model), with a 0.75 ms
floor for any size. vLLM's CPU build ships the shared-memory all-reduce that its own CPU tensor
parallelism runs on (``torch.ops._C.shm_allreduce``): 2 ms and 28 ms for the same sizes, 6 us
for a scalar.

:func:`new_group` returns a torch.distributed process group (registered backend ``"hfshm"``)
whose SUM all-reduces of contiguous fp32/bf16/fp16 CPU tensors run on those kernels; every
other collective goes to an ordinary gloo group on the same ranks. Callers keep calling
``dist.all_reduce(t, group=g)``, so megatron-core's tensor-parallel layers need no change
(workers/engines/megatron.py swaps its TP groups for these). Where shared memory cannot serve
the group (ranks on several hosts, no /dev/shm, a GPU run, vLLM's CPU kernels missing) or is
not asked for, it returns a plain group of the default backend.

Two uses, each with its own default (``HYBRIDFLOW_SHM_COLLECTIVES``: unset = the defaults below,
``1`` = both, ``0`` = neither):

- **Data-parallel gradients, on by default** (:func:`gradient_group`,
  workers/engines/fsdp_layout.py ``ReduceAfterBackward``): DDP's buckets are held until backward
  ends and then all-reduced here, one call each (100 MB: 24 ms, against gloo's 72 ms and 56 ms of
  CPU on a 2-core Xeon, 2026-12-01). gloo reduces each bucket on threads of its own while backward
  runs, on the cores backward needs; the step gains 1.06-1.20x at 8 rows a rank and nothing
  measurable at 64 (scripts/bench/engines.py --gloo-too, docs/benchmarks.md). Only where every
  rank of the group is on this host with cores of its own.
- **Megatron's tensor-parallel all-reduces, opt-in** (:func:`enabled`): many small all-reduces on
  the critical path of every layer, where gloo's cost is latency.

The kernel waits for its peers by spinning. With a core per rank that is what makes it fast; on a
shared or oversubscribed machine a spinning rank burns the time its descheduled peer needs. For
tensor parallelism that happens at every layer: on a 2-vCPU VM, e2e medium at tp=2, the update
took 3.47 s with it against 3.82 s on gloo while the host was quiet, and 7.78 s against 3.13 s
while another tenant took a quarter of the CPU (26% steal), hence opt-in. For gradients it happens
once a step, and only for as long as the ranks' backward passes differ: handing DDP this group
instead (each bucket all-reduced inside backward, the rank ahead spinning on the one behind) had
made the update 1.5x slower (3.71 s against 2.43 s on gloo), the reason the gradients wait for the
end. Not for DeviceMesh/DTensor: their functional collectives dispatch in C++, where a
Python-defined group's methods are not reliably reached (an FSDP2 mesh built on one deadlocked in
``full_tensor()``), so sharded FSDP stays on gloo.

What differs from gloo: the shared-memory all-reduce has no timeout of its own. A rank whose peer
died waits until its process is killed; the controller fails the step as soon as any rank dies
(WorkerGroup collects fail-fast) and tears the group down, so nothing hangs.
"""
from __future__ import annotations

import os
import socket
import uuid
from typing import Sequence

import torch
import torch.distributed as dist

import hybridflow.device  # noqa: F401  (applies HYBRIDFLOW_CPU_ISA before vLLM's kernels load)
from hybridflow import shm_names
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions,
                                        AllreduceOptions, BarrierOptions, BroadcastOptions,
                                        ReduceOp, ReduceScatterOptions, _create_work_from_future)
from torch.futures import Future

BACKEND = "hfshm"
ENV_SWITCH = "HYBRIDFLOW_SHM_COLLECTIVES"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unlink_shm_segment(name: str, rank: int) -> None:
    """Remove the /dev/shm name of this rank's buffer in vLLM's ``SHMManager`` group ``name``
    (``init_shm_manager`` creates "<name>_<rank in group>"); the mappings stay valid. Missing
    is fine: callers also use it to clear a stale name before creating it."""
    try:
        os.unlink(f"/dev/shm/{name}_{rank}")
    except OSError:
        pass


def _kernels_available() -> bool:
    """vLLM's CPU build has the kernels in its AVX512 libraries only; HYBRIDFLOW_CPU_ISA=avx2
    answers as an AVX2-only CPU would even where vLLM already loaded those (cpu_isa.py)."""
    from hybridflow import cpu_isa

    if cpu_isa.forced_avx2():
        return False
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C on the CPU build)
    except Exception:
        return False
    return hasattr(torch.ops._C, "init_shm_manager") and hasattr(torch.ops._C, "shm_allreduce")


def _host_id() -> str:
    """Processes with equal ids share /dev/shm: same host name and same boot (a container
    restart or another machine with the same name gets a new boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class SharedMemoryGroup(dist.ProcessGroup):
    """gloo on the same ranks for everything, except float SUM all-reduces on one host.

    Built by torch.distributed through the registered backend (see :func:`new_group`), never
    directly: torch then records its ranks, so ``dist.get_rank(group)`` and friends work.
    """

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._handle = None
        # every member publishes its host; shared memory only if all are on this one
        store.set(f"host/{rank}", _host_id())
        hosts = {store.get(f"host/{r}").decode() for r in range(size)}
        if len(hosts) != 1 or not os.path.isdir("/dev/shm"):  # new_group checked the kernels
            return
        if rank == 0:  # the owner in the name lets a later run remove it if this one is killed
            shm_names.sweep_stale()
            store.set("shm_name", f"hfshm-{shm_names.owner_tag()}-{uuid.uuid4().hex[:12]}")
        name = store.get("shm_name").decode()
        threads = torch.tensor([torch.get_num_threads()], dtype=torch.int64)
        self._gloo.allreduce([threads], _min_opts()).wait()
        handle = torch.ops._C.init_shm_manager(name, size, rank, int(threads))
        self._gloo.barrier(BarrierOptions()).wait()
        torch.ops._C.join_shm_manager(handle, name)
        self._gloo.barrier(BarrierOptions()).wait()
        # every member has mapped every buffer: drop the names now, so a killed process leaves
        # nothing in /dev/shm (the mappings live until the processes exit)
        unlink_shm_segment(name, rank)
        self._gloo.barrier(BarrierOptions()).wait()  # so no name is left once new_group returns
        self._handle = handle

    @property
    def uses_shared_memory(self) -> bool:
        return self._handle is not None

    # ------------------------------------------------------------------ the fast path
    def _shared(self, *tensors) -> bool:
        return self._handle is not None and all(
            t.device.type == "cpu" and t.dtype in _DTYPES and t.is_contiguous() for t in tensors)

    def allreduce(self, tensors, opts=AllreduceOptions()):
        if opts.reduceOp == ReduceOp.SUM and self._shared(*tensors):
            for t in tensors:
                torch.ops._C.shm_allreduce(self._handle, t)
            return _completed(tensors)
        return self._gloo.allreduce(tensors, opts)

    # ------------------------------------------------------------------ everything else: gloo
    def allreduce_coalesced(self, tensors, opts=AllreduceCoalescedOptions()):
        return self._gloo.allreduce_coalesced(tensors, opts)

    def allgather(self, outputs, inputs, opts=AllgatherOptions()):
        return self._gloo.allgather(outputs, inputs, opts)

    def all_gather_single(self, output, inp, opts=AllgatherOptions()):
        return self._gloo._allgather_base(output, inp, opts)

    def allgather_coalesced(self, outputs, inputs, opts=AllgatherOptions()):
        return self._gloo.allgather_coalesced(outputs, inputs, opts)

    def broadcast(self, tensors, opts=BroadcastOptions()):
        return self._gloo.broadcast(tensors, opts)

    def barrier(self, opts=BarrierOptions()):
        return self._gloo.barrier(opts)

    def reduce(self, tensors, opts):
        return self._gloo.reduce(tensors, opts)

    def reduce_scatter(self, outputs, inputs, opts=ReduceScatterOptions()):
        return self._gloo.reduce_scatter(outputs, inputs, opts)

    def reduce_scatter_single(self, output, inp, opts=ReduceScatterOptions()):
        return self._gloo._reduce_scatter_base(output, inp, opts)

    def gather(self, outputs, inputs, opts):
        return self._gloo.gather(outputs, inputs, opts)

    def scatter(self, outputs, inputs, opts):
        return self._gloo.scatter(outputs, inputs, opts)

    def alltoall(self, outputs, inputs, opts):
        return self._gloo.alltoall(outputs, inputs, opts)

    def all_to_all_single(self, output, inp, output_splits, input_splits, opts):
        return self._gloo.alltoall_base(output, inp, output_splits, input_splits, opts)

    def send(self, tensors, dst: int, tag: int):
        return self._gloo.send(tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int):
        return self._gloo.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag: int):
        return self._gloo.recv_anysource(tensors, tag)

    def size(self) -> int:
        return self._gloo.size()

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND


def _completed(result):
    done = Future()
    done.set_result(result)
    return _create_work_from_future(done)


def _min_opts() -> AllreduceOptions:
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MIN
    return opts


def enabled() -> bool:
    """Shared-memory groups for tensor parallelism are wanted: a CPU run, asked for
    (``HYBRIDFLOW_SHM_COLLECTIVES=1``), vLLM's kernels present."""
    from hybridflow import device

    if device.device_type() != "cpu" or os.environ.get(ENV_SWITCH, "0") != "1":
        return False
    return _kernels_available()


def gradients_enabled(ranks: int) -> bool:
    """Data-parallel gradients of ``ranks`` ranks may go through shared memory: a CPU run, not
    turned off (``HYBRIDFLOW_SHM_COLLECTIVES=0``), vLLM's kernels present, and cores enough for
    every rank's threads if they all share this host (else a rank's spin would take a core its
    peer needs; ranks on several hosts fall back to gloo in :func:`gradient_group`)."""
    from hybridflow import device

    if device.device_type() != "cpu" or os.environ.get(ENV_SWITCH, "") == "0" or ranks < 2:
        return False
    from hybridflow.auto_cpu_layout import host_cores

    if ranks * torch.get_num_threads() > host_cores(None):
        return False
    return _kernels_available()


def gradient_group(ranks: Sequence[int]) -> dist.ProcessGroup | None:
    """A shared-memory group on ``ranks`` for their gradient all-reduces, or None unless every one
    of them may (:func:`gradients_enabled`) and they are all on one host. Collective: every rank of
    the world calls it, with the same ranks; the ranks decide together, so hosts of different
    CPUs (kernels on one, not on another) or a switch set on one rank only cannot split them
    between a new group and none."""
    from hybridflow import device

    ranks = sorted(int(r) for r in ranks)
    if device.device_type() != "cpu" or len(ranks) < 2:
        return None
    mine = (gradients_enabled(len(ranks)) and os.path.isdir("/dev/shm"), _host_id())
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    members = [every[r] for r in ranks]
    if not all(ok for ok, _ in members) or len({host for _, host in members}) != 1:
        return None
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, SharedMemoryGroup, devices=["cpu"])
    return dist.new_group(ranks, backend=BACKEND)


def new_group(ranks: Sequence[int]) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` with shared-memory all-reduces where :func:`enabled`.

    Collective like ``dist.new_group``: every rank of the world calls it, with the same ranks,
    in the same order. A group of one rank, or one that shared memory cannot serve, is a plain
    group of the default backend."""
    ranks = sorted(int(r) for r in ranks)
    if len(ranks) < 2 or not enabled():
        return dist.new_group(ranks)
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, SharedMemoryGroup, devices=["cpu"])
    return dist.new_group(ranks, backend=BACKEND)
