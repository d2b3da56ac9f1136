"""Execute a reshard plan bucket by bucket, and stream FSDP weights the same way.

Unlike a gather-then-broadcast sync, a rank never holds more than one bucket of HF tensors, and
only the region vLLM's loader on that rank reads (``plan.needed``) is ever transmitted or
written; the rest of each full-size tensor is uninitialised memory vLLM never reads.

The exchange inside a bucket is one batched point-to-point round (``batch_isend_irecv``), one
message per (source, destination) pair: with the paper's strided generation groups this is
exactly the micro-DP and pipeline all-gathers; with vLLM's consecutive groups it is the
permutation those groups need, which no single all-gather expresses.

Every rank must consume a stream to the end (it runs collectives); ``drain`` finishes one.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from resharding.plan import Piece, ReshardPlan

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass
class TransferStats:
    """What one rank did in its last stream: bytes over the wire, local copies, wall time spent
    in this module (not in the consumer), buckets, and the largest bucket's extra memory."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    seconds: float = 0.0
    buckets: int = 0
    peak_bucket_bytes: int = 0

    def reset(self) -> None:
        self.__init__()


def drain(stream: Iterable) -> None:
    """Run a stream to its end so that every rank finishes the same collectives."""
    for _ in stream:
        pass


class Resharder:
    """Moves Megatron-sharded weights into the per-rank full-size HF tensors vLLM loads.

    ``bucket_bytes`` bounds the full-size HF tensors alive at once (a single tensor larger than
    it gets a bucket of its own). Plan ranks are ranks of ``group`` (default: the world).
    """

    def __init__(self, plan: ReshardPlan, bucket_bytes: int = DEFAULT_BUCKET_BYTES, group=None):
        if bucket_bytes <= 0:
            raise ValueError(f"reshard bucket_bytes={bucket_bytes} must be > 0 (e.g. {DEFAULT_BUCKET_BYTES})")
        self.plan, self.bucket_bytes, self.group = plan, bucket_bytes, group
        self.rank = dist.get_rank(group)
        if dist.get_world_size(group) != plan.train.world:
            raise ValueError(f"reshard plan is for {plan.train.world} ranks but the process group has "
                             f"{dist.get_world_size(group)}; build the plan from this group's layout")
        self.stats = TransferStats()

    def _buckets(self, itemsize: int) -> list[list[int]]:
        buckets, current, size = [], [], 0
        for ti, t in enumerate(self.plan.tensors):
            nbytes = math.prod(t.shape) * itemsize
            if current and size + nbytes > self.bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(ti)
            size += nbytes
        if current:
            buckets.append(current)
        return buckets

    def _peer(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _check_dtype(self, dtype: torch.dtype, device: torch.device) -> None:
        """Bucket boundaries depend on the element size: all ranks must agree or they deadlock."""
        size = torch.tensor([dtype.itemsize, -dtype.itemsize], device=device)
        dist.all_reduce(size, op=dist.ReduceOp.MAX, group=self.group)
        if int(size[0]) != -int(size[1]):
            raise ValueError(f"ranks hold parameters of different element sizes ({-int(size[1])} to "
                             f"{int(size[0])} bytes); use one param_dtype on every rank before resharding")

    def stream(self, local_params: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full-size tensor)`` for every HF tensor of the model, bucket by bucket.

        ``local_params``: this rank's Megatron parameters by their stage-local names (the table's
        ``name``). In each yielded tensor only ``plan.needed[(index, rank)]`` is valid.
        """
        if not local_params:
            raise ValueError("reshard got no local parameters; pass the Megatron module's named_parameters()")
        first = next(iter(local_params.values()))
        dtype, device = first.dtype, first.device
        if any(p.dtype != dtype for p in local_params.values()):
            raise ValueError("reshard needs one dtype for all local parameters (mixed dtypes found)")
        self._check_dtype(dtype, device)
        stats = self.stats  # reset in place: callers may hold this object (generate_mode does)
        stats.reset()
        by_tensor: dict[int, list[Piece]] = defaultdict(list)
        for p in self.plan.pieces:
            if self.rank in (p.src, p.dst):
                by_tensor[p.tensor].append(p)
        for bucket in self._buckets(dtype.itemsize):
            start = time.perf_counter()
            out = {ti: torch.empty(self.plan.tensors[ti].shape, dtype=dtype, device=device) for ti in bucket}
            sends: dict[int, list[torch.Tensor]] = defaultdict(list)
            recvs: dict[int, list[Piece]] = defaultdict(list)
            for ti in bucket:
                for p in by_tensor[ti]:
                    if p.src == p.dst:
                        self._region(out[ti], p).copy_(self._source(local_params, p))
                        stats.bytes_local += self.plan.numel(p) * dtype.itemsize
                    elif p.src == self.rank:
                        sends[p.dst].append(self._source(local_params, p).reshape(-1))
                    else:
                        recvs[p.src].append(p)
            send_bufs = {dst: torch.cat(parts) for dst, parts in sends.items()}
            recv_bufs = {src: torch.empty(sum(self.plan.numel(p) for p in ps), dtype=dtype, device=device)
                         for src, ps in recvs.items()}
            ops = [dist.P2POp(dist.isend, buf, self._peer(dst), self.group) for dst, buf in sorted(send_bufs.items())]
            ops += [dist.P2POp(dist.irecv, buf, self._peer(src), self.group) for src, buf in sorted(recv_bufs.items())]
            if ops:
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            for src, ps in recvs.items():
                offset = 0
                for p in ps:
                    region = self._region(out[p.tensor], p)
                    region.copy_(recv_bufs[src][offset:offset + region.numel()].view(region.shape))
                    offset += region.numel()
            sent = sum(b.numel() for b in send_bufs.values()) * dtype.itemsize
            received = sum(b.numel() for b in recv_bufs.values()) * dtype.itemsize
            stats.bytes_sent += sent
            stats.bytes_received += received
            stats.buckets += 1
            stats.peak_bucket_bytes = max(stats.peak_bucket_bytes, sent + received +
                                          sum(t.numel() for t in out.values()) * dtype.itemsize)
            del send_bufs, recv_bufs
            stats.seconds += time.perf_counter() - start
            for ti in bucket:
                yield self.plan.tensors[ti].hf_name, out.pop(ti)

    def _source(self, local_params: Mapping[str, torch.Tensor], p: Piece) -> torch.Tensor:
        t = self.plan.tensors[p.tensor]
        try:
            src = local_params[t.train_name]
        except KeyError:
            raise KeyError(f"reshard: rank {self.rank} should hold Megatron parameter {t.train_name!r} "
                           f"(stage {t.stage}) but local_params lacks it") from None
        src = src.detach()
        return src if p.dim is None else src.narrow(p.dim, p.src_start, p.stop - p.start)

    @staticmethod
    def _region(x: torch.Tensor, p: Piece) -> torch.Tensor:
        return x if p.dim is None else x.narrow(p.dim, p.start, p.stop - p.start)


def fsdp_to_hf_stream(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      stats: TransferStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield full tensors of FSDP (DTensor-sharded) parameters, gathered ``bucket_bytes`` at a time.

    Names pass through unchanged (FSDP wraps an HF model, so they are HF names already). Every
    rank gets every full tensor: vLLM narrows them to its generation shard.
    """
    from torch.distributed.tensor import DTensor

    stats = stats if stats is not None else TransferStats()
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush():
        start = time.perf_counter()
        full = []
        for name, t in pending:
            t = t.detach()
            if isinstance(t, DTensor):
                local = t.to_local().numel() * t.element_size()
                t = t.full_tensor()
                moved = t.numel() * t.element_size() - local
                stats.bytes_received += moved
                stats.bytes_sent += moved  # a ring all-gather sends as much as it receives
            full.append((name, t))
        stats.buckets += 1
        stats.peak_bucket_bytes = max(stats.peak_bucket_bytes, sum(t.numel() * t.element_size() for _, t in full))
        stats.seconds += time.perf_counter() - start
        return full

    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if pending and size + nbytes > bucket_bytes:
            yield from flush()
            pending, size = [], 0
        pending.append((name, t))
        size += nbytes
    if pending:
        yield from flush()
