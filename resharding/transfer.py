"""Execute a reshard plan bucket by bucket, and stream FSDP weights the same way.

Unlike a gather-then-broadcast sync, a rank never holds more than one bucket of HF tensors, and
only the region vLLM's loader on that rank reads (``plan.needed``) is ever transmitted or
written; the rest of each full-size tensor is uninitialised memory vLLM never reads.

The exchange inside a bucket is one point-to-point round, one message per (source, destination)
pair: with the paper's strided generation groups this is exactly the micro-DP and pipeline
all-gathers; with vLLM's consecutive groups it is the permutation those groups need, which no
single all-gather expresses. On CPU, ranks of one host read each other's parameters directly
(``shared_params.py``: the parameters live in shared memory; zero-copy), or, where /dev/shm lacks
the room for that, exchange through bucket-sized shared buffers (``host_exchange.py``: one copy
in, one copy out); elsewhere the round is one ``batch_isend_irecv`` over the group's backend
(NCCL on GPUs).

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

from resharding.host_exchange import HostExchange, _all_ok
from resharding.shared_params import SharedParameters
from resharding.plan import Piece, ReshardPlan

DEFAULT_BUCKET_BYTES = 256 << 20
# "auto": shared memory between the ranks of one host on CPU (shared_params.py, else
# host_exchange.py), else batched point-to-point through the process group's backend ("p2p":
# always the latter).
TRANSPORTS = ("auto", "shm", "p2p")


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


def split_into_buckets(items: Iterable[tuple[int, int]], bucket_bytes: int) -> list[list[int]]:
    """Group ``(index, nbytes)`` in order into buckets of at most ``bucket_bytes`` (a larger item
    gets a bucket of its own). Every rank must split alike: buckets are collective rounds."""
    buckets, current, size = [], [], 0
    for i, nbytes in items:
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def check_transfer_settings(bucket_bytes: int, transport: str) -> None:
    if bucket_bytes <= 0:
        raise ValueError(f"reshard bucket_bytes={bucket_bytes} must be > 0 (e.g. {DEFAULT_BUCKET_BYTES})")
    if transport not in TRANSPORTS:
        raise ValueError(f"reshard transport={transport!r} is unknown: use one of {TRANSPORTS}")


def drain(stream: Iterable) -> None:
    """Run a stream to its end so that every rank finishes the same collectives."""
    for _ in stream:
        pass


class Resharder:
    """Moves Megatron-sharded weights into the per-rank full-size HF tensors vLLM loads.

    ``bucket_bytes`` bounds the full-size HF tensors alive at once (a single tensor larger than
    it gets a bucket of its own). Plan ranks are ranks of ``group`` (default: the world).
    ``zero_copy=False`` keeps the parameters where they are and uses bucket-sized shared buffers
    on CPU (what happens anyway where /dev/shm cannot hold the parameters).
    """

    def __init__(self, plan: ReshardPlan, bucket_bytes: int = DEFAULT_BUCKET_BYTES, group=None,
                 transport: str = "auto", zero_copy: bool = True):
        check_transfer_settings(bucket_bytes, transport)
        self.plan, self.bucket_bytes, self.group, self.transport = plan, bucket_bytes, group, transport
        self.zero_copy = zero_copy
        self.rank = dist.get_rank(group)
        if dist.get_world_size(group) != plan.train.world:
            raise ValueError(f"reshard plan is for {plan.train.world} ranks but the process group has "
                             f"{dist.get_world_size(group)}; build the plan from this group's layout")
        self.stats = TransferStats()
        self._host: HostExchange | None = None
        self._shared: SharedParameters | None = None
        self._decided_for = 0  # the element size the transport was chosen (buffers sized) for
        self._bucket_moves: list[bool] = []

    @property
    def uses_shared_memory(self) -> bool:
        return self._host is not None or self._shared is not None

    @property
    def reads_peer_parameters(self) -> bool:
        """Zero-copy: receivers read the owners' live parameters (shared_params.py)."""
        return self._shared is not None

    def _order(self) -> list[int]:
        """Tensor indices, the pipeline stages interleaved (stage 0's first, stage 1's first, ...).

        A stage's tensors sit on its ranks only, so in plan order a bucket would have one stage's
        ranks sending and the others only receiving, each side waiting for the other in turn;
        mixed buckets keep every rank writing and reading at once. Within a stage the order (layer
        by layer, which vLLM's reload buffers least for) is kept."""
        by_stage: dict[int, list[int]] = defaultdict(list)
        for ti, t in enumerate(self.plan.tensors):
            by_stage[t.stage].append(ti)
        lists = [by_stage[s] for s in sorted(by_stage)]
        return [ti for k in range(max(map(len, lists), default=0)) for lst in lists if k < len(lst)
                for ti in lst[k:k + 1]]

    def _buckets(self, itemsize: int) -> list[list[int]]:
        return split_into_buckets(((ti, math.prod(self.plan.tensors[ti].shape) * itemsize) for ti in self._order()),
                                  self.bucket_bytes)

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
        buckets = self._buckets(dtype.itemsize)
        self._choose_transport(buckets, dtype, device, local_params)
        fence = time.perf_counter()
        # Zero-copy: this all-reduce is also the fence after every owner's last parameter update.
        if self._shared is not None and not _all_ok(self._shared.intact(local_params), self.group):
            self.close()  # a parameter was re-pointed since it was shared (an offload): share again
            self._choose_transport(buckets, dtype, device, local_params)
        stats.seconds += time.perf_counter() - fence
        shared = self._shared
        for b, bucket in enumerate(buckets):
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
                        sends[p.dst].append(self._source(local_params, p))
                    else:
                        recvs[p.src].append(p)
            if shared is not None:
                sent, received = self._read_peers(sends, recvs, out, dtype)
            elif self._host is not None:
                sent = received = 0
                if self._bucket_moves[b]:  # else no rank has a piece to move: skip the barriers
                    sent, received = self._exchange_shared(sends, recvs, out, dtype)
            else:
                sent, received = self._exchange_p2p(sends, recvs, out, dtype, device)
            stats.bytes_sent += sent
            stats.bytes_received += received
            stats.buckets += 1
            buffers = 0 if shared is not None else sent + received  # zero-copy: no staging buffers
            stats.peak_bucket_bytes = max(stats.peak_bucket_bytes, buffers +
                                          sum(t.numel() for t in out.values()) * dtype.itemsize)
            if shared is not None and b == len(buckets) - 1:
                # every read is done before any owner steps again; placed before the last yield so
                # that it does not also wait for the peers' rollout to load the last bucket
                dist.barrier(group=self.group)
            stats.seconds += time.perf_counter() - start
            for ti in bucket:
                yield self.plan.tensors[ti].hf_name, out.pop(ti)

    def _choose_transport(self, buckets: list[list[int]], dtype: torch.dtype, device: torch.device,
                          local_params: Mapping[str, torch.Tensor]) -> None:
        """Share the parameters (or map buffers sized to this element size's buckets) the first
        time: a collective.

        Plans where nothing crosses ranks (tp_g = tp) map nothing: the p2p path then has no ops."""
        if self.transport == "p2p" or self._decided_for == dtype.itemsize:
            return
        self.close()
        self._decided_for = dtype.itemsize
        if device.type != "cpu" or dist.get_world_size(self.group) == 1:
            if self.transport == "shm":
                raise ValueError("reshard transport='shm' needs CPU tensors and more than one rank; "
                                 "use transport='auto'")
            return
        bucket_of = {ti: b for b, bucket in enumerate(buckets) for ti in bucket}
        per_bucket: list[dict[tuple[int, int], int]] = [defaultdict(int) for _ in buckets]
        self._bucket_moves = [False] * len(buckets)  # does any rank send anything (alike on every rank)
        for p in self.plan.pieces:
            if p.src != p.dst:
                b = bucket_of[p.tensor]
                self._bucket_moves[b] = True
                if self.rank in (p.src, p.dst):
                    per_bucket[b][(p.src, p.dst)] += self.plan.numel(p) * dtype.itemsize
        if not any(self._bucket_moves):  # every rank's generation shard is local: nothing to map
            return
        if self.zero_copy:
            self._shared = SharedParameters.share(local_params, self.group)
            if self._shared is not None:
                return
        capacity: dict[tuple[int, int], int] = defaultdict(int)
        for in_bucket in per_bucket:
            for pair, n in in_bucket.items():
                capacity[pair] = max(capacity[pair], n)
        self._host = HostExchange.open(capacity, self.group, required=self.transport == "shm")

    def close(self) -> None:
        """Drop the shared buffers (they are mapped again by the next stream)."""
        if self._host is not None:
            self._host.close()
        if self._shared is not None:
            self._shared.close()
        self._host, self._shared, self._decided_for = None, None, 0

    def _exchange_shared(self, sends, recvs, out, dtype) -> tuple[int, int]:
        """Pieces go straight from the parameters into the pair's buffer and out into ``out``."""
        sent = 0
        for dst, parts in sends.items():
            view = self._host.send_view(dst, sum(t.numel() for t in parts), dtype)
            offset = 0
            for t in parts:
                view[offset:offset + t.numel()].view(t.shape).copy_(t)
                offset += t.numel()
            sent += offset * dtype.itemsize
        self._host.fence()  # every write of this round is done before anyone reads
        received = self._unpack({src: self._host.recv_view(src, sum(self.plan.numel(p) for p in ps), dtype)
                                 for src, ps in recvs.items()}, recvs, out)
        self._host.fence()  # every read is done before the next round overwrites the buffers
        return sent, received

    def _read_peers(self, sends, recvs, out, dtype) -> tuple[int, int]:
        """Zero-copy: each received piece is copied straight from its owner's live parameter."""
        received = 0
        for src, ps in recvs.items():
            for p in ps:
                region = self._region(out[p.tensor], p)
                owner = self._shared.peer(src, self.plan.tensors[p.tensor].train_name)
                region.copy_(owner if p.dim is None else owner.narrow(p.dim, p.src_start, p.stop - p.start))
                received += region.numel()
        return sum(t.numel() for parts in sends.values() for t in parts) * dtype.itemsize, received * dtype.itemsize

    def _exchange_p2p(self, sends, recvs, out, dtype, device) -> tuple[int, int]:
        """One batched isend/irecv round, one contiguous message per (source, destination)."""
        send_bufs = {dst: torch.cat([t.reshape(-1) for t in parts]) for dst, parts in sends.items()}
        recv_bufs = {src: torch.empty(sum(self.plan.numel(p) for p in ps), dtype=dtype, device=device)
                     for src, ps in recvs.items()}
        ops = [dist.P2POp(dist.isend, buf, self._peer(dst), self.group) for dst, buf in sorted(send_bufs.items())]
        ops += [dist.P2POp(dist.irecv, buf, self._peer(src), self.group) for src, buf in sorted(recv_bufs.items())]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return sum(b.numel() for b in send_bufs.values()) * dtype.itemsize, self._unpack(recv_bufs, recvs, out)

    def _unpack(self, flat: dict[int, torch.Tensor], recvs: dict[int, list[Piece]], out) -> int:
        """Copy each source's contiguous message into its pieces' regions; returns bytes read."""
        received = 0
        for src, ps in recvs.items():
            offset = 0
            for p in ps:
                region = self._region(out[p.tensor], p)
                region.copy_(flat[src][offset:offset + region.numel()].view(region.shape))
                offset += region.numel()
            received += offset * flat[src].element_size()
        return received

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
