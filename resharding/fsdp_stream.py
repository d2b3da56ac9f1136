"""Stream an FSDP2 model's full HF tensors into the rollout, one bucket at a time.

FSDP2 keeps every parameter as a DTensor sharded along dim 0 (``torch.chunk`` rows); vLLM wants
full tensors (its loaders narrow them to the generation shard). ``DTensor.full_tensor()`` is one
all-gather per parameter, which over gloo means TCP loopback on one host: a 25M-parameter model took
0.43 s to sync on 2 CPU ranks. On CPU ranks of one host each rank instead writes its shards of a
bucket into one shared buffer (``host_exchange.py``, a broadcast buffer) and every rank assembles the
full tensors from all the buffers: one copy in, one copy out, two barriers per bucket. Anything
else (GPUs, several hosts, HSDP's 2-D meshes, no room in /dev/shm) uses ``full_tensor()``.
Replicated parameters (``fsdp_size=1``: plain tensors) pass through without communication.
"""
from __future__ import annotations

import math
import time
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from resharding.host_exchange import EVERY, HostExchange
from resharding.transfer import DEFAULT_BUCKET_BYTES, TransferStats, check_transfer_settings, split_into_buckets


def _rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows of a dim-0 ``Shard`` held by ``rank``: DTensor shards like ``torch.chunk``."""
    chunk = math.ceil(n / world) if n else 0
    return min(rank * chunk, n), min((rank + 1) * chunk, n)


class FSDPWeightStream:
    """``stream(named_parameters)`` yields ``(hf_name, full tensor)`` pairs, ``bucket_bytes`` of full
    tensors at a time; ``stats`` counts what moved. Keep one per model: the shared buffers are
    mapped on the first call and reused (every rank must call ``stream`` the same number of times).
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, transport: str = "auto",
                 stats: TransferStats | None = None):
        check_transfer_settings(bucket_bytes, transport)
        self.bucket_bytes, self.transport = bucket_bytes, transport
        self.stats = stats if stats is not None else TransferStats()
        self._host: HostExchange | None = None
        self._decided_for = None  # (mesh group, per-bucket shapes) the transport was chosen for

    @property
    def uses_shared_memory(self) -> bool:
        return self._host is not None

    def _buckets(self, items: list[tuple[str, torch.Tensor]]) -> list[list[int]]:
        return split_into_buckets(((i, t.numel() * t.element_size()) for i, (_, t) in enumerate(items)),
                                  self.bucket_bytes)

    def _choose_transport(self, items, buckets) -> None:
        """Map shared buffers if every DTensor is a dim-0 shard on one 1-D CPU mesh (collective)."""
        from torch.distributed.tensor import DTensor, Shard

        dtensors = [t for _, t in items if isinstance(t, DTensor)]
        if self.transport == "p2p" or not dtensors:
            return
        mesh = dtensors[0].device_mesh
        eligible = (mesh.ndim == 1 and mesh.device_type == "cpu" and mesh.size() > 1
                    and len({t.dtype for t in dtensors}) == 1 and all(
                        t.device_mesh == mesh and tuple(t.placements) == (Shard(0),) for t in dtensors))
        if not eligible:
            if self.transport == "shm":
                raise ValueError("reshard transport='shm' needs FSDP parameters sharded on dim 0 over one "
                                 "1-D CPU mesh of more than one rank; use transport='auto'")
            return
        group, world = mesh.get_group(), mesh.size()
        key = (group, tuple((t.dtype, tuple(t.shape)) for _, t in items))
        if self._decided_for == key:
            return
        self.close()
        self._decided_for = key
        capacity = {}
        for src in range(world):
            capacity[(src, EVERY)] = max(
                sum(self._local_numel(items[i][1], world, src) * items[i][1].element_size() for i in bucket)
                for bucket in buckets)
        # the buffers are laid out by torch.chunk rows: a rank whose shards differ says no before
        # any round starts (a mid-round error would leave its peers waiting at a barrier)
        me = mesh.get_local_rank()
        chunk_rows = all(t.to_local().numel() == self._local_numel(t, world, me) for t in dtensors)
        self._host = HostExchange.open(capacity, group, local_ok=chunk_rows, required=self.transport == "shm")

    @staticmethod
    def _local_numel(t: torch.Tensor, world: int, rank: int) -> int:
        from torch.distributed.tensor import DTensor

        if not isinstance(t, DTensor):
            return 0
        start, stop = _rows(t.shape[0], world, rank)
        return (stop - start) * math.prod(t.shape[1:])

    def close(self) -> None:
        """Drop the shared buffers (the next stream maps them again)."""
        if self._host is not None:
            self._host.close()
        self._host, self._decided_for = None, None

    def stream(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        from torch.distributed.tensor import DTensor

        items = [(name, t.detach()) for name, t in named_tensors]
        buckets = self._buckets(items)
        self._choose_transport(items, buckets)
        stats = self.stats
        stats.reset()
        for bucket in buckets:
            start = time.perf_counter()
            if self._host is not None:
                full = self._gather_shared([items[i] for i in bucket])
            else:
                full = []
                for name, t in (items[i] for i in bucket):
                    if isinstance(t, DTensor):
                        local = t.to_local().numel() * t.element_size()
                        t = t.full_tensor()
                        moved = t.numel() * t.element_size() - local
                        stats.bytes_received += moved
                        stats.bytes_sent += moved  # a ring all-gather sends as much as it receives
                    full.append((name, t))
            stats.buckets += 1
            stats.peak_bucket_bytes = max(stats.peak_bucket_bytes,
                                          sum(t.numel() * t.element_size() for _, t in full))
            stats.seconds += time.perf_counter() - start
            yield from full

    def _gather_shared(self, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        from torch.distributed.tensor import DTensor

        host = self._host
        world, me = dist.get_world_size(host.group), host.rank
        sharded = [(i, t) for i, (_, t) in enumerate(bucket) if isinstance(t, DTensor)]
        full = [t if not isinstance(t, DTensor) else
                torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device) for _, t in bucket]
        dtype = sharded[0][1].dtype if sharded else torch.float32
        mine = sum(self._local_numel(t, world, me) for _, t in sharded)
        view, offset = host.send_view(EVERY, mine, dtype), 0
        for i, t in sharded:
            local = t.to_local()
            start, stop = _rows(t.shape[0], world, me)
            view[offset:offset + local.numel()].view(local.shape).copy_(local)
            full[i][start:stop].copy_(local)
            offset += local.numel()
        host.fence()
        received = 0
        for src in range(world):
            if src == me:
                continue
            total = sum(self._local_numel(t, world, src) for _, t in sharded)
            view, offset = host.recv_view(src, total, dtype, dst=EVERY), 0
            for i, t in sharded:
                start, stop = _rows(t.shape[0], world, src)
                n = (stop - start) * math.prod(t.shape[1:])
                full[i][start:stop].copy_(view[offset:offset + n].view(stop - start, *t.shape[1:]))
                offset += n
            received += total * dtype.itemsize
        host.fence()
        self.stats.bytes_received += received
        self.stats.bytes_sent += mine * dtype.itemsize  # written once, read by every other rank
        return [(name, t) for (name, _), t in zip(bucket, full)]


def fsdp_to_hf_stream(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      stats: TransferStats | None = None, transport: str = "p2p") -> Iterator[tuple[str, torch.Tensor]]:
    """One-off stream (no buffers kept between calls); workers keep an :class:`FSDPWeightStream`."""
    return FSDPWeightStream(bucket_bytes, transport, stats).stream(named_tensors)
