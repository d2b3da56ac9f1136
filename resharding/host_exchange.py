"""Point-to-point rounds through shared memory, for the ranks of one host on CPU.

gloo has no shared-memory transport: between two processes of one machine it sends over TCP
loopback, so every byte is copied into a send buffer, through the kernel's socket buffers and out
of a receive buffer. Here each (sender, receiver) pair owns one tmpfs-backed buffer mapped in both
processes: the sender writes its pieces straight from its parameters into it, the receiver copies
them straight into the tensor vLLM loads, and a barrier between the two orders the writes before
the reads (a second one keeps the next round's writes behind this round's reads). This is what CUDA
IPC does for colocated GPU workers; NCCL already takes that path, so this is used only on CPU.

The buffers are sized once, to the largest round of each pair, and unlinked as soon as both sides
have mapped them: nothing is left in /dev/shm if a worker dies, and the pages go away with the last
mapping (``close()`` or the process's end).
"""
from __future__ import annotations

import os
import uuid
from typing import Mapping

import torch
import torch.distributed as dist

from hybridflow import shm_names

SHM_DIR = "/dev/shm"
EVERY = -1  # as a destination: one buffer that every other rank of the group reads (a broadcast)


def _create(path: str, nbytes: int) -> bool:
    """Create ``path`` with all its pages reserved now; False where tmpfs lacks the room.

    posix_fallocate turns "no space" into an error here, instead of a SIGBUS at the first write
    into a page tmpfs cannot back (a container's small /dev/shm)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return True
    except OSError:
        os.unlink(path)
        return False
    finally:
        os.close(fd)


def _shm_writable() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def _group_token(group) -> str:
    """A fresh name every rank of ``group`` agrees on (a collective: rank 0's owner tag and a
    uuid). Rank 0 first removes the segments that runs killed mid-share left (shm_names.py)."""
    token = [None]
    if dist.get_rank(group) == 0:
        shm_names.sweep_stale(SHM_DIR)
        token = [f"{shm_names.owner_tag()}-{uuid.uuid4().hex}"]
    dist.broadcast_object_list(token, src=_global_rank(group, 0), group=group)
    return token[0]


def _all_ok(ok: bool, group) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class HostExchange:
    """Shared buffers for the ``(src, dst) -> bytes`` pairs of ``capacity`` (ranks of ``group``;
    ``dst`` may be ``EVERY``).

    Build with :meth:`open` (a collective on ``group``). One round: each sender fills
    ``send_view(dst, ...)``, every rank calls ``fence()``, each receiver reads
    ``recv_view(src, ...)`` (``dst=EVERY`` for a broadcast buffer), every rank calls ``fence()``.
    """

    def __init__(self, group, rank: int, sends: dict[int, torch.Tensor],
                 recvs: dict[tuple[int, int], torch.Tensor], paths: list[str]):
        self.group, self.rank = group, rank
        self._sends, self._recvs = sends, recvs
        self.paths = paths  # the names this rank created or mapped (all unlinked by now)

    @classmethod
    def open(cls, capacity: Mapping[tuple[int, int], int], group=None, local_ok: bool = True,
             required: bool = False) -> "HostExchange | None":
        """Map every pair's buffer on both of its ranks, or return None on every rank.

        None means shared memory cannot serve this group: no /dev/shm, not enough room in it,
        ranks that do not see each other's files (other hosts or other IPC namespaces), or a rank
        that passed ``local_ok=False``. ``required``: raise instead, on every rank (the caller
        asked for transport='shm'). Every rank of ``group`` must call this with the same
        ``capacity``.
        """
        rank = dist.get_rank(group)
        token = _group_token(group)

        def path(src: int, dst: int) -> str:
            to = "all" if dst == EVERY else dst
            return os.path.join(SHM_DIR, f"hybridflow-reshard-{token}-{src}-{to}")

        mine = {dst: n for (src, dst), n in capacity.items() if src == rank and n > 0}
        created = []
        ok = local_ok and _shm_writable()
        for dst, n in sorted(mine.items()):
            if not ok:
                break
            ok = _create(path(rank, dst), n)
            if ok:
                created.append(path(rank, dst))
        sends, recvs = {}, {}
        try:
            if _all_ok(ok, group):
                for dst, n in mine.items():
                    sends[dst] = torch.from_file(path(rank, dst), shared=True, size=n, dtype=torch.uint8)
                for (src, dst), n in capacity.items():
                    if n > 0 and (dst == rank or (dst == EVERY and src != rank)):
                        if not os.path.exists(path(src, dst)):
                            ok = False
                            break
                        recvs[(src, dst)] = torch.from_file(path(src, dst), shared=True, size=n,
                                                            dtype=torch.uint8)
                ok = _all_ok(ok, group)  # also the barrier after which every buffer is mapped
            else:
                ok = False
        finally:
            for p in created:  # mapped where needed (or given up): the names can go
                os.unlink(p)
        if not ok:
            if required:
                raise RuntimeError("reshard transport='shm': shared memory cannot serve these ranks (other "
                                   "hosts, too little room in /dev/shm, or tensors it cannot lay out); use transport='auto' or 'p2p'")
            return None
        used = [path(src, dst) for src, dst in capacity if rank in (src, dst) or dst == EVERY]
        return cls(group, rank, sends, recvs, used)

    def send_view(self, dst: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._sends[dst][:numel * dtype.itemsize].view(dtype)

    def recv_view(self, src: int, numel: int, dtype: torch.dtype, dst: int | None = None) -> torch.Tensor:
        return self._recvs[(src, self.rank if dst is None else dst)][:numel * dtype.itemsize].view(dtype)

    def fence(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        self._sends, self._recvs = {}, {}


def _global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
