"""Weights as self-describing byte buckets: the unit a trainer pool hands to a separate rollout pool.

A stream of ``(HF name, full tensor)`` becomes buckets of at most ``bucket_bytes`` (a larger
tensor gets a bucket of its own); each bucket is one contiguous uint8 CPU buffer plus a header
saying where each tensor lies in it. A buffer is something any transport moves as is (Ray's object
store, shared memory, a broadcast), and ``unpack_bucket`` reads tensors back as views of it.

What differs from a plain ``torch.save`` of a state dict:
- one bucket is packed at a time, each tensor copied (and, from a GPU, moved) straight into its
  place in the buffer: at most one bucket of packed bytes exists at once, no per-tensor CPU copy;
- floating tensors may be cast to the rollout's dtype while packing (``cast_to``): a bf16 engine
  is sent half the bytes of an fp32 trainer's weights, and since vLLM's loader casts to its own
  dtype anyway, what it holds afterwards is the same;
- unpacking makes no copy: each tensor is a view of the buffer, also of a read-only one (an array
  from Ray's object store). Such views must only be read, which is all a weight loader does.

Plain torch: no Ray, no workers. The header is plain data (picklable, small).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

# every tensor starts at a multiple of this: any dtype's view of its bytes is then aligned
# (torch requires the byte offset to divide by the element size; 64 also suits SIMD loads)
ALIGN = 64


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in its bucket's buffer."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketHeader:
    entries: tuple[TensorEntry, ...]
    nbytes: int  # the buffer's length: the end of its last tensor


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight bucket header names dtype {name!r}, which this torch does not have")
    return dtype


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 cast_to: torch.dtype | None = None) -> Iterator[tuple[BucketHeader, torch.Tensor]]:
    """Yield ``(header, buffer)`` per bucket: ``buffer`` a 1-D contiguous uint8 CPU tensor.

    Tensors keep their order. ``cast_to``: floating tensors are packed in this dtype (integer and
    bool tensors as they are). The generator drops its reference to a bucket when it yields it, so
    a consumer that ships each buffer off before asking for the next holds at most one.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    buffer: torch.Tensor | None = None
    entries: list[TensorEntry] = []
    used = 0
    for name, tensor in named_tensors:
        dtype = cast_to if cast_to is not None and tensor.is_floating_point() else tensor.dtype
        nbytes = tensor.numel() * dtype.itemsize
        offset = _aligned(used)
        if entries and offset + nbytes > bucket_bytes:
            full, buffer = buffer[:used], None
            yield BucketHeader(tuple(entries), used), full
            entries, used, offset = [], 0, 0
        if buffer is None:
            # sized for a whole bucket (a larger tensor: for itself); only the used part is shipped
            buffer = torch.empty(max(bucket_bytes, nbytes), dtype=torch.uint8)
        if nbytes:
            # one copy: device to host and dtype cast happen in this copy_
            buffer[offset:offset + nbytes].view(dtype).view(tensor.shape).copy_(tensor.detach())
        entries.append(TensorEntry(name, _dtype_name(dtype), tuple(tensor.shape), offset, nbytes))
        used = offset + nbytes
    if entries:
        full, buffer = buffer[:used], None
        yield BucketHeader(tuple(entries), used), full


def unpack_bucket(header: BucketHeader, buffer) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each entry, every tensor a view of ``buffer`` (no copy).

    ``buffer``: a uint8 torch tensor or anything with the buffer protocol (a numpy array, possibly
    read-only, as Ray's object store returns it). Read-only memory stays read-only: write to a
    returned tensor only after cloning it.
    """
    if not isinstance(buffer, torch.Tensor):
        with warnings.catch_warnings():
            # torch warns that writes to a non-writable buffer are undefined: these views are only read
            warnings.filterwarnings("ignore", message=".*not writable.*")
            buffer = torch.frombuffer(buffer, dtype=torch.uint8) if len(memoryview(buffer)) else \
                torch.empty(0, dtype=torch.uint8)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < header.nbytes:
        raise ValueError(f"weight bucket buffer is {buffer.dtype} of shape {tuple(buffer.shape)}; its header "
                         f"needs 1-D uint8 of at least {header.nbytes} bytes")
    out = []
    for e in header.entries:
        dtype = _dtype_of(e.dtype)
        view = buffer[e.offset:e.offset + e.nbytes].view(dtype).view(e.shape)
        out.append((e.name, view))
    return out


@dataclass(frozen=True)
class StagedWeights:
    """One weight version, packed and handed over: what a trainer pool gives a rollout pool.

    ``buckets[i]`` holds ``headers[i]``'s buffer in whatever transport the stager used (Ray
    ObjectRefs of uint8 arrays for ``ActorRolloutRefWorker.stage_weights``): small and picklable,
    so the controller passes it on without touching the bytes. ``seconds``: the stager's time to
    stream, pack and hand over every bucket.
    """

    version: int
    buckets: tuple
    headers: tuple[BucketHeader, ...]
    total_bytes: int
    seconds: float

    def __post_init__(self):
        if len(self.buckets) != len(self.headers):
            raise ValueError(f"StagedWeights: {len(self.buckets)} buckets but {len(self.headers)} headers")
