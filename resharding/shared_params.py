"""Training parameters that live in shared memory, so that CPU ranks of one host read each
other's shards directly (zero-copy resharding).

The textbook hybrid engine sends each missing shard: the owner copies it into a send buffer, the
buffer travels, the receiver copies it out (``host_exchange.py`` cuts that to one copy in and one
copy out). On GPUs verl avoids even that with CUDA IPC handles to the live parameters. This is
the same on CPU: each rank moves its parameters' storage into one tmpfs file that every other rank
of the group maps, and a receiver copies a piece straight from the owner's live parameter into the
tensor vLLM loads. A stream then needs two barriers in all (the owners' optimizer steps are done
before anyone reads; every read is done before anyone steps again) instead of two per bucket, and
no bytes are written for others.

The parameters keep their identity (same ``nn.Parameter`` objects, ``.data`` re-pointed, values
unchanged), so optimizers and checkpoints are unaffected. Anything that later re-points a
parameter (an offload, ``load_state_dict(assign=True)``) is noticed by :meth:`intact` and the
caller shares again. The files are unlinked as soon as every rank has mapped them: nothing stays
in /dev/shm if a worker dies, and the pages go with the last mapping.
"""
from __future__ import annotations

import math
import os
from typing import Mapping

import torch
import torch.distributed as dist

from resharding import host_exchange
from resharding.host_exchange import _all_ok, _create, _group_token, _shm_writable

ALIGN = 64  # bytes: every parameter starts on a cache line


def _view(storage: torch.Tensor, start: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` at byte ``start`` of a mapped uint8 file."""
    return storage[start:start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


class SharedParameters:
    """This rank's parameters in a mapped file, and read-only views of every peer's.

    Build with :meth:`share` (a collective on ``group``); ``peer(rank, name)`` is the live
    parameter ``name`` of group rank ``rank``.
    """

    def __init__(self, rank: int, layouts: list[dict[str, tuple[int, tuple[int, ...]]]],
                 storages: dict[int, torch.Tensor], dtype: torch.dtype, own_base: int):
        self.rank, self.dtype = rank, dtype
        self._layouts, self._storages, self._own_base = layouts, storages, own_base

    @classmethod
    def share(cls, params: Mapping[str, torch.Tensor], group=None) -> "SharedParameters | None":
        """Move every tensor of ``params`` (one dtype, on CPU) into this rank's shared file and
        map every other rank's; None on every rank where shared memory cannot serve the group
        (no /dev/shm, too little room in it, ranks on other hosts or in other IPC namespaces)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        token = _group_token(group)

        def path(r: int) -> str:  # SHM_DIR read at call time: tests point it elsewhere
            return os.path.join(host_exchange.SHM_DIR, f"hybridflow-params-{token}-{r}")

        tensors = list(params.values())
        dtype = tensors[0].dtype if tensors else torch.float32
        layout, offset = {}, 0
        for name, t in params.items():
            layout[name] = (offset, tuple(t.shape))
            offset += -(-t.numel() * dtype.itemsize // ALIGN) * ALIGN
        nbytes = max(offset, ALIGN)
        ok = (all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
              and _shm_writable() and _create(path(rank), nbytes))
        created = [path(rank)] if ok else []
        try:
            if not _all_ok(ok, group):
                return None
            layouts: list = [None] * world
            dist.all_gather_object(layouts, (nbytes, layout), group=group)
            storages = {}
            for r, (size, _) in enumerate(layouts):
                if r != rank and not os.path.exists(path(r)):
                    ok = False
                    break
                storages[r] = torch.from_file(path(r), shared=True, size=size, dtype=torch.uint8)
            views = {}
            if ok:  # the values go in before the barrier below: peers may read them right after it
                with torch.no_grad():
                    for name, t in params.items():
                        views[name] = _view(storages[rank], *layout[name], dtype)
                        views[name].copy_(t)
            if not _all_ok(ok, group):  # also the barrier after which every file is mapped and filled
                return None
        finally:
            for p in created:
                os.unlink(p)
        for name, t in params.items():
            t.data = views[name]
        own = storages[rank]
        return cls(rank, [lay for _, lay in layouts], storages, dtype, own.data_ptr())

    def intact(self, params: Mapping[str, torch.Tensor]) -> bool:
        """Whether every tensor of ``params`` still lives where :meth:`share` put it."""
        layout = self._layouts[self.rank]
        if params.keys() != layout.keys():
            return False
        return all(t.dtype == self.dtype and tuple(t.shape) == layout[n][1] and t.is_contiguous()
                   and t.data_ptr() == self._own_base + layout[n][0] for n, t in params.items())

    def peer(self, rank: int, name: str) -> torch.Tensor:
        """Group rank ``rank``'s live parameter ``name`` (read it only between the stream's fences)."""
        try:
            start, shape = self._layouts[rank][name]
        except KeyError:
            raise KeyError(f"reshard: rank {rank} shares no parameter {name!r}") from None
        return _view(self._storages[rank], start, shape, self.dtype)

    def close(self) -> None:
        """Drop the peers' mappings; this rank's parameters keep their (still valid) storage."""
        self._storages = {r: s for r, s in self._storages.items() if r == self.rank}
