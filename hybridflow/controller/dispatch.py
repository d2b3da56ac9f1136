"""How a group call's arguments are split across workers and how their results are joined.

A ``DispatchMode`` is a pair of plain functions, so a user can write their own:

    dispatch_fn(group, *args, **kwargs) -> list of (args, kwargs), one per worker rank
                                           (or (that list, ctx) where ctx is a dict of keywords
                                           passed on to collect_fn)
    collect_fn(group, outputs: list, **ctx) -> the value the driver sees

The built-in modes (verl's names): ONE_TO_ALL, ALL_TO_ALL, DP_COMPUTE_PROTO, and ``mesh(name)``,
which splits by the data-parallel rank each worker declared with ``Worker.register_mesh`` and
collects only from the ranks that declared ``is_collect`` (e.g. TP rank 0 of the last PP stage),
so the controller needs no knowledge of the training backend.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from hybridflow.controller import spans
from hybridflow.protocol import DataProto

MAGIC_ATTR = "_hybridflow_register"


class Execute(Enum):
    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class DispatchMode:
    dispatch_fn: Callable
    collect_fn: Callable
    name: str = "custom"
    mesh_name: str | None = None  # set for mesh-aware modes: the group resolves ranks lazily


# ---------------------------------------------------------------- ONE_TO_ALL
def _one_to_all_dispatch(group, *args, **kwargs):
    return [(args, kwargs)] * group.world_size


def _list_collect(group, outputs, **ctx):
    return outputs


# ---------------------------------------------------------------- ALL_TO_ALL
def _all_to_all_dispatch(group, *args, **kwargs):
    """Each argument is a list with one entry per worker: worker i gets entry i."""
    n = group.world_size
    for a in list(args) + list(kwargs.values()):
        if not isinstance(a, (list, tuple)) or len(a) != n:
            raise ValueError(f"ALL_TO_ALL dispatch needs every argument to be a list of {n} items "
                             f"(one per worker), got {type(a).__name__}")
    return [(tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()}) for i in range(n)]


# ---------------------------------------------------------------- data-parallel splitting
def split_by_dp(value, dp_size: int):
    """Split one argument into dp_size parts. DataProto (or its future) pads to divisible;
    anything else is replicated. Returns (parts, pad)."""
    from hybridflow.controller.future import DataProtoFuture

    if isinstance(value, DataProtoFuture):
        return value.split_for(dp_size), value.pad_for(dp_size)
    if isinstance(value, DataProto):
        return value.dp_chunks(dp_size)
    return [value] * dp_size, None


def _dp_dispatch(dp_ranks: list[int], dp_size: int, args, kwargs):
    pads = []
    split_args = []
    for a in args:
        parts, pad = split_by_dp(a, dp_size)
        split_args.append(parts)
        pads.append(pad)
    split_kwargs = {}
    for k, v in kwargs.items():
        parts, pad = split_by_dp(v, dp_size)
        split_kwargs[k] = parts
        pads.append(pad)
    real = {p for p in pads if p is not None}
    if len(real) > 1:
        raise ValueError(f"data-parallel dispatch: DataProto arguments of different lengths (pads {real})")
    pad = real.pop() if real else 0
    calls = [(tuple(parts[d] for parts in split_args), {k: parts[d] for k, parts in split_kwargs.items()})
             for d in dp_ranks]
    rows = {len(x) for parts in split_args + list(split_kwargs.values()) for x in parts[:1] if isinstance(x, DataProto)}
    return calls, pad, (rows.pop() * dp_size if len(rows) == 1 else None)


def concat_outputs(outputs: list, pad: int, rows: int | None = None):
    """Join per-dp-rank outputs: DataProto parts are concatenated and the padding stripped.

    ``rows`` is the padded input length. A method may return k rows per input row (generation
    with n samples per prompt); the padding rows' outputs are then the last ``pad * k`` rows.
    """
    if outputs and all(isinstance(o, DataProto) for o in outputs):
        out = DataProto.concat(outputs)
        if pad and rows and len(out) != rows:
            if len(out) % rows:
                raise ValueError(f"data-parallel collect: {len(out)} output rows for {rows} input rows is not a "
                                 "whole number of rows per input; cannot strip the padding")
            pad *= len(out) // rows
        return out.unpad(pad)
    return outputs


def _dp_compute_dispatch(group, *args, **kwargs):
    calls, pad, rows = _dp_dispatch(list(range(group.world_size)), group.world_size, args, kwargs)
    return calls, {"pad": pad, "rows": rows}


def _dp_compute_collect(group, outputs, pad=0, rows=None):
    return concat_outputs(outputs, pad, rows)


def mesh(mesh_name: str) -> DispatchMode:
    """Dispatch by the data-parallel rank each worker registered under ``mesh_name``."""

    def dispatch_fn(group, *args, **kwargs):
        info = group.mesh_info(mesh_name)
        calls, pad, rows = _dp_dispatch(info.dp_ranks, info.dp_size, args, kwargs)
        return calls, {"pad": pad, "rows": rows}

    def collect_fn(group, outputs, pad=0, rows=None):
        info = group.mesh_info(mesh_name)
        chosen = sorted(((info.dp_ranks[r], r), outputs[r]) for r in range(len(outputs)) if info.collect[r])
        return concat_outputs([o for _, o in chosen], pad, rows)

    return DispatchMode(dispatch_fn, collect_fn, name=f"mesh:{mesh_name}", mesh_name=mesh_name)


class Dispatch:
    ONE_TO_ALL = DispatchMode(_one_to_all_dispatch, _list_collect, "ONE_TO_ALL")
    ALL_TO_ALL = DispatchMode(_all_to_all_dispatch, _list_collect, "ALL_TO_ALL")
    DP_COMPUTE_PROTO = DispatchMode(_dp_compute_dispatch, _dp_compute_collect, "DP_COMPUTE_PROTO")
    mesh = staticmethod(mesh)


def register(dispatch_mode: DispatchMode = Dispatch.ALL_TO_ALL, execute_mode: Execute = Execute.ALL,
             blocking: bool = True):
    """Mark a Worker method as a group method: the WorkerGroup binds it as dispatch -> execute -> collect.

    Inside the worker the wrapper resolves any future slices handed over by a non-blocking call of
    another group, so the driver never materialises intermediate batches. While the run records its
    timeline (controller/spans.py) the call is a stage span named after the method, or after the
    ``stage`` of its first DataProto's meta_info (validation's generation says ``validation``);
    waiting for another group's output (resolving a future) is not part of it.
    """
    if not isinstance(dispatch_mode, DispatchMode):
        raise TypeError(f"register(dispatch_mode=...) takes a DispatchMode, got {dispatch_mode!r}")

    def decorator(fn):
        @functools.wraps(fn)
        def inner(self, *args, **kwargs):
            from hybridflow.controller.future import materialize

            args = tuple(materialize(a) for a in args)
            kwargs = {k: materialize(v) for k, v in kwargs.items()}
            if not spans.recording():
                return fn(self, *args, **kwargs)
            with spans.span(_stage_name(fn.__name__, args)):
                return fn(self, *args, **kwargs)

        setattr(inner, MAGIC_ATTR, {"dispatch_mode": dispatch_mode, "execute_mode": execute_mode,
                                    "blocking": blocking})
        return inner

    return decorator


def _stage_name(method: str, args: tuple) -> str:
    first = args[0] if args else None
    return first.meta_info.get("stage", method) if isinstance(first, DataProto) else method


def registered_methods(cls) -> dict[str, dict[str, Any]]:
    """Every @register-decorated method of a class (including inherited ones)."""
    found = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        attr = getattr(cls, name, None)
        spec = getattr(attr, MAGIC_ATTR, None)
        if spec is not None:
            found[name] = spec
    return found
