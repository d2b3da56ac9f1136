"""Futures of non-blocking group calls.

A non-blocking call returns at once. Its ``DataProtoFuture`` holds the Ray object references of
the per-rank output parts; handed to the next group call it is split without the driver ever
fetching the data:
- same data-parallel size on both sides: part i goes to dp rank i as a top-level Ray argument
  (Ray resolves it inside the worker, zero driver copies);
- different sizes: each worker receives a small ``_FutureSlice`` (references only), fetches the
  parts itself, and keeps its own chunk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import os

import ray

from hybridflow.protocol import DataProto


def _fetch(refs: list):
    """Fetch producer outputs inside a consumer; bounded like every other wait."""
    return ray.get(refs, timeout=float(os.environ.get("HYBRIDFLOW_CALL_TIMEOUT_S", "1800")))


@dataclass
class _FutureSlice:
    parts: list  # ray.ObjectRef of DataProto parts in dp order
    pad: int
    dp_size: int
    index: int

    def resolve(self) -> DataProto:
        full = DataProto.concat(_fetch(self.parts)).unpad(self.pad)
        return full.dp_chunks(self.dp_size)[0][self.index]


class GroupFuture:
    """The pending result of a non-blocking group call; ``get()`` waits (with the group's timeout)."""

    def __init__(self, group, method: str, refs: list, collect: Callable[[list], Any]):
        self._group, self._method, self._refs, self._collect = group, method, refs, collect

    def get(self):
        return self._collect(self._group._wait(self._refs, self._method))


class DataProtoFuture(GroupFuture):
    """A future whose value is a DataProto built from ``parts`` (refs, dp order) minus ``pad`` rows."""

    def __init__(self, group, method: str, refs: list, collect: Callable, parts: list, pad: int):
        super().__init__(group, method, refs, collect)
        self.parts, self.pad = parts, pad

    def split_for(self, dp_size: int) -> list:
        if dp_size == len(self.parts):
            return list(self.parts)
        return [_FutureSlice(self.parts, self.pad, dp_size, i) for i in range(dp_size)]

    def pad_for(self, dp_size: int) -> int:
        n_parts = len(self.parts)
        if dp_size == n_parts:
            return self.pad
        # Row count is unknown without fetching; the consumer pads the true length. We only need the
        # pad to strip after collecting, which equals (-true_len) % dp_size: fetch the lengths lazily.
        lengths = _fetch([_part_len.remote(p) for p in self.parts])
        true_len = sum(lengths) - self.pad
        return (-true_len) % dp_size

    def __reduce__(self):
        # Shipped to a worker (e.g. a ONE_TO_ALL argument): only the references travel.
        return (_RemoteDataProtoFuture, (self.parts, self.pad))


@ray.remote(num_cpus=0)
def _part_len(part: DataProto) -> int:
    return len(part)


@dataclass
class _RemoteDataProtoFuture:
    parts: list
    pad: int

    def resolve(self) -> DataProto:
        return DataProto.concat(_fetch(self.parts)).unpad(self.pad)


def materialize(value):
    """Inside a worker: turn future slices into DataProto; leave everything else alone."""
    if isinstance(value, (_FutureSlice, _RemoteDataProtoFuture)):
        return value.resolve()
    return value
