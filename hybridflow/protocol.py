"""DataProto: the one batch type that flows between the controller and the worker groups.

A ``tensordict.TensorDict`` of tensors that share the batch dimension, plus non-tensor columns
as numpy object arrays of the same length, plus a free ``meta_info`` dict (settings such as the
temperature that travel with the batch rather than per row).

What differs from a plain dict of tensors: every row operation (chunk, repeat, reorder, pad)
keeps the tensor and non-tensor columns aligned, and ``union`` refuses to silently overwrite a
column with different values.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from tensordict import TensorDict

# meta_info key on the parts of a data-parallel split that was padded: how many rows are copies
DP_PADDING_ROWS = "dp_padding_rows"


def _as_object_array(values) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == object:
        return values
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


def _index_numpy(col: np.ndarray, idx) -> np.ndarray:
    if isinstance(idx, torch.Tensor):
        idx = idx.cpu().numpy()
    return col[idx]


@dataclass
class DataProto:
    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        n = len(self.batch) if self.batch is not None and self.batch.batch_size else None
        for key, col in list(self.non_tensor_batch.items()):
            col = _as_object_array(col)
            self.non_tensor_batch[key] = col
            if n is None:
                n = len(col)
            elif len(col) != n:
                raise ValueError(f"DataProto: non-tensor column {key!r} has {len(col)} rows, batch has {n}")

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor] | None = None,
                  non_tensors: dict[str, Sequence] | None = None,
                  meta_info: dict[str, Any] | None = None) -> "DataProto":
        tensors = tensors or {}
        batch = None
        if tensors:
            sizes = {k: v.shape[0] for k, v in tensors.items()}
            if len(set(sizes.values())) != 1:
                raise ValueError(f"DataProto.from_dict: tensors disagree on batch size: {sizes}")
            batch = TensorDict(dict(tensors), batch_size=[next(iter(sizes.values()))])
        non = {k: _as_object_array(v) for k, v in (non_tensors or {}).items()}
        return cls(batch=batch, non_tensor_batch=non, meta_info=dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict | None = None) -> "DataProto":
        """Split one dict into tensor and non-tensor columns by value type."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, non, meta_info)

    # ---------------------------------------------------------------- basics
    def __len__(self) -> int:
        if self.batch is not None and self.batch.batch_size:
            return int(self.batch.batch_size[0])
        if self.non_tensor_batch:
            return len(next(iter(self.non_tensor_batch.values())))
        return 0

    def __getitem__(self, idx) -> "DataProto":
        """Rows by int, slice, bool mask or index array/tensor; always returns a DataProto."""
        if isinstance(idx, int):
            idx = slice(idx, idx + 1) if idx != -1 else slice(-1, None)
        if isinstance(idx, (list, np.ndarray)):
            idx = torch.as_tensor(np.asarray(idx))
        batch = self.batch[idx] if self.batch is not None else None
        non = {k: _index_numpy(v, idx) for k, v in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non, meta_info=dict(self.meta_info))

    def keys(self) -> list[str]:
        return list(self.batch.keys()) if self.batch is not None else []

    def __repr__(self) -> str:
        cols = {k: tuple(v.shape) for k, v in (self.batch.items() if self.batch is not None else [])}
        return (f"DataProto(len={len(self)}, tensors={cols}, "
                f"non_tensors={list(self.non_tensor_batch)}, meta_info={list(self.meta_info)})")

    # ---------------------------------------------------------------- columns
    def select(self, batch_keys=None, non_tensor_batch_keys=None, meta_info_keys=None) -> "DataProto":
        batch = None
        if self.batch is not None:
            batch = self.batch.select(*batch_keys) if batch_keys is not None else self.batch
        non = ({k: self.non_tensor_batch[k] for k in non_tensor_batch_keys}
               if non_tensor_batch_keys is not None else dict(self.non_tensor_batch))
        meta = ({k: self.meta_info[k] for k in meta_info_keys}
                if meta_info_keys is not None else dict(self.meta_info))
        return DataProto(batch=batch, non_tensor_batch=non, meta_info=meta)

    def pop(self, batch_keys=(), non_tensor_batch_keys=(), meta_info_keys=()) -> "DataProto":
        """Remove the named columns from self and return them as a new DataProto."""
        tensors = {k: self.batch.pop(k) for k in batch_keys}
        non = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys}
        return DataProto.from_dict(tensors, non, meta)

    def union(self, other: "DataProto") -> "DataProto":
        """Add other's columns to self (in place, returned). A shared key must hold equal values."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"DataProto.union: lengths differ ({len(self)} vs {len(other)})")
        if other.batch is not None:
            if self.batch is None:
                self.batch = other.batch
            else:
                for k, v in other.batch.items():
                    if k in self.batch.keys() and not torch.equal(self.batch[k], v):
                        raise ValueError(f"DataProto.union: tensor {k!r} differs between the two batches")
                    self.batch[k] = v
        for k, v in other.non_tensor_batch.items():
            if k in self.non_tensor_batch and not _object_arrays_equal(self.non_tensor_batch[k], v):
                raise ValueError(f"DataProto.union: non-tensor {k!r} differs between the two batches")
            self.non_tensor_batch[k] = v
        for k, v in other.meta_info.items():
            if k in self.meta_info and not _values_equal(self.meta_info[k], v):
                raise ValueError(f"DataProto.union: meta_info {k!r} differs ({self.meta_info[k]!r} vs {v!r})")
            self.meta_info[k] = v
        return self

    # ---------------------------------------------------------------- rows
    def chunk(self, chunks: int) -> list["DataProto"]:
        """Split into ``chunks`` contiguous parts; len must divide (pad first: pad_to_divisor)."""
        if len(self) % chunks:
            raise ValueError(f"DataProto.chunk: {len(self)} rows do not split into {chunks} equal chunks; "
                             "call pad_to_divisor first")
        size = len(self) // chunks
        return [self[i * size:(i + 1) * size] for i in range(chunks)]

    def split(self, split_size: int) -> list["DataProto"]:
        """Parts of ``split_size`` rows (the last may be shorter)."""
        return [self[i:i + split_size] for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(parts: Sequence["DataProto"]) -> "DataProto":
        """Rows of the parts in order; meta_info merged, later parts winning, except ``metrics`` (one
        dict per worker, e.g. per generation-DP rank): each key's mean over the parts that have it,
        so a step logs all ranks' timings and shares, not only the last rank's."""
        parts = [p for p in parts if p is not None]
        if not parts:
            raise ValueError("DataProto.concat: nothing to concatenate")
        batch = None
        if parts[0].batch is not None:
            batch = torch.cat([p.batch for p in parts], dim=0)
        non = {k: np.concatenate([p.non_tensor_batch[k] for p in parts]) for k in parts[0].non_tensor_batch}
        meta = {}
        for p in parts:
            meta.update(p.meta_info)
        per_part = [p.meta_info["metrics"] for p in parts if isinstance(p.meta_info.get("metrics"), dict)]
        if len(per_part) > 1:
            meta["metrics"] = _mean_metrics(per_part)
        return DataProto(batch=batch, non_tensor_batch=non, meta_info=meta)

    def repeat(self, repeat_times: int, interleave: bool = True) -> "DataProto":
        """Repeat rows: interleaved gives a,a,b,b (n samples of one prompt adjacent); else a,b,a,b."""
        n = len(self)
        if interleave:
            idx = torch.arange(n).repeat_interleave(repeat_times)
        else:
            idx = torch.arange(n).repeat(repeat_times)
        return self[idx]

    def reorder(self, indices: torch.Tensor) -> "DataProto":
        """Return rows in the given order (e.g. a balancing permutation)."""
        return self[torch.as_tensor(indices)]

    def pad_to_divisor(self, divisor: int) -> tuple["DataProto", int]:
        """Append copies of leading rows so len is a multiple of divisor; returns (padded, pad)."""
        pad = (-len(self)) % divisor
        if pad == 0:
            return self, 0
        if len(self) == 0:
            raise ValueError("DataProto.pad_to_divisor: cannot pad an empty batch")
        idx = torch.cat([torch.arange(len(self)), torch.arange(pad) % len(self)])
        return self[idx], pad

    def dp_chunks(self, dp_size: int) -> tuple[list["DataProto"], int]:
        """``dp_size`` equal parts after padding with copies of leading rows, and the pad. Every part
        of a padded split carries ``meta_info[DP_PADDING_ROWS]`` = pad, so a method that must not
        see a row twice (a training step) can refuse it on every rank alike."""
        padded, pad = self.pad_to_divisor(dp_size)
        parts = padded.chunk(dp_size)
        if pad:
            for part in parts:
                part.meta_info[DP_PADDING_ROWS] = pad
        return parts, pad

    def unpad(self, pad: int) -> "DataProto":
        """Drop the last ``pad`` rows (a padded split's copies) and the padding marker."""
        out = self[: len(self) - pad] if pad else self
        if DP_PADDING_ROWS in out.meta_info:
            out = DataProto(batch=out.batch, non_tensor_batch=out.non_tensor_batch,
                            meta_info={k: v for k, v in out.meta_info.items() if k != DP_PADDING_ROWS})
        return out

    def make_iterator(self, mini_batch_size: int, epochs: int = 1, shuffle: bool = False,
                      seed: int | None = None) -> Iterator["DataProto"]:
        """Mini-batches over ``epochs`` passes; a seeded permutation per epoch when shuffling."""
        if len(self) % mini_batch_size:
            raise ValueError(f"DataProto.make_iterator: batch of {len(self)} is not a multiple of "
                             f"mini_batch_size={mini_batch_size}")
        gen = torch.Generator().manual_seed(seed if seed is not None else 0)
        for _ in range(epochs):
            data = self.reorder(torch.randperm(len(self), generator=gen)) if shuffle else self
            yield from data.split(mini_batch_size)

    # ---------------------------------------------------------------- placement and storage
    def to(self, device) -> "DataProto":
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def contiguous(self) -> "DataProto":
        if self.batch is not None:
            self.batch = self.batch.contiguous()
        return self

    def save_to_disk(self, path: str) -> None:
        with open(path, "wb") as f:
            pickle.dump(self, f)

    @staticmethod
    def load_from_disk(path: str) -> "DataProto":
        with open(path, "rb") as f:
            return pickle.load(f)

    def __getstate__(self):
        # Ship plain contiguous tensors: TensorDict pickles fine, but a sliced view would drag its
        # whole parent storage across Ray; .contiguous() copies only views, not owned tensors.
        tensors = None
        if self.batch is not None:
            tensors = {k: (v if v.is_contiguous() and v.storage_offset() == 0 and
                           v.untyped_storage().nbytes() == v.nbytes else v.contiguous().clone())
                       for k, v in self.batch.items()}
        return {"tensors": tensors, "batch_size": list(self.batch.batch_size) if self.batch is not None else None,
                "non_tensor_batch": self.non_tensor_batch, "meta_info": self.meta_info}

    def __setstate__(self, state):
        tensors = state["tensors"]
        self.batch = TensorDict(tensors, batch_size=state["batch_size"]) if tensors is not None else None
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]


def _mean_metrics(dicts: list[dict]) -> dict:
    """Each key's mean over the dicts that have it (a value all agree on is kept as is, a
    non-number is the last one's)."""
    out = {}
    for key in dict.fromkeys(k for d in dicts for k in d):
        values = [d[key] for d in dicts if key in d]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if numeric and any(v != values[0] for v in values):
            out[key] = sum(values) / len(values)
        else:
            out[key] = values[-1]
    return out


def _object_arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))


def _values_equal(a, b) -> bool:
    try:
        eq = a == b
        if isinstance(eq, np.ndarray):
            return bool(eq.all())
        if isinstance(eq, torch.Tensor):
            return bool(eq.all())
        return bool(eq)
    except Exception:
        return a is b
