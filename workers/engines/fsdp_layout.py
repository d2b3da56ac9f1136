"""Where the FSDP engine's parameters live across its data-parallel ranks (``fsdp_size``).

verl's ``fsdp_config.fsdp_size`` picks one of three layouts:

- ``-1`` (default) or ``dp``: FSDP. Every parameter is sharded over all ranks; each decoder layer
  is its own unit and the root unit holds embeddings, final norm and heads.
- ``1 < k < dp``: HSDP. Sharded within groups of ``k`` ranks and replicated across groups (a 2D
  mesh ``(dp/k, k)``); FSDP2 reduce-scatters within a group and all-reduces across groups.
- ``1``: replicated. Every rank holds the full model and ``DistributedDataParallel`` all-reduces
  the gradients: on one CPU host through shared memory once backward ends
  (``ReduceAfterBackward``), elsewhere DDP's own, bucketed and overlapped with backward. No
  forward gathers parameters and the weight sync to the rollout is a local copy. For models that
  fit a device several times over this is the fast layout: on a 2-core CPU at 25M parameters a
  training step measured 2.5 s vs 3.3 s sharded, and the sync to vLLM went from 0.43 s to 0.12 s.

The HF module itself is what callers keep: sharded layouts change it in place (FSDP2), the
replicated one wraps it in a DDP object used only for training forwards.
"""
from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from hybridflow import device as hf_device
from hybridflow import shm_group


def resolve_shard_size(fsdp_size: int, dp_size: int) -> int:
    """Ranks that share one copy of the parameters; ValueError naming the fix if it cannot be."""
    size = dp_size if fsdp_size == -1 else fsdp_size
    if size < 1 or size > dp_size or dp_size % size:
        divisors = [d for d in range(1, dp_size + 1) if dp_size % d == 0]
        raise ValueError(f"FSDPEngine: fsdp_size={fsdp_size} must divide the {dp_size} data-parallel ranks: "
                         f"use -1 (shard over all), 1 (replicate) or one of {divisors}")
    return size


def place(model: torch.nn.Module, *, shard_size: int, dp_size: int, param_dtype: str,
          trainable: bool, prefetch: bool = True) -> torch.nn.parallel.DistributedDataParallel | None:
    """Lay ``model`` out in place; returns the DDP wrapper in the replicated layout (None for a
    frozen model, which needs no gradient reduction, for a single rank, and for the sharded layouts)."""
    if shard_size == 1 and dp_size == 1:
        # one rank: nothing to shard or reduce; FSDP2 on a 1-rank mesh would still copy every
        # layer's parameters in and out (and cast them) around each forward and backward
        return None
    if shard_size == 1 and dp_size > 1:
        if not trainable:
            return None
        # gradients live in the all-reduce buckets (no copy in or out); buffers (RoPE tables) are
        # equal on every rank, so nothing is re-broadcast before each forward
        ddp = torch.nn.parallel.DistributedDataParallel(model, forward_sync_buffers=False,
                                                        gradient_as_bucket_view=True)
        group = shm_group.gradient_group(range(dp_size))
        ddp.reduce_after_backward = None
        if group is not None:
            ddp.reduce_after_backward = ReduceAfterBackward(group)
            ddp.register_comm_hook(ddp.reduce_after_backward, ReduceAfterBackward.hook)
        return ddp
    if shard_size == dp_size:
        mesh = init_device_mesh(hf_device.device_type(), (dp_size,), mesh_dim_names=("dp",))
    else:  # HSDP: dim 0 replicates, dim 1 shards (FSDP2 reads a 2D mesh this way)
        mesh = init_device_mesh(hf_device.device_type(), (dp_size // shard_size, shard_size),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    if param_dtype == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"FSDPEngine: found no decoder layers ({sorted(layer_classes)}) in "
                         f"{type(model).__name__}; this engine supports HF decoder-only models")
    # reshard_after_forward stays True: with False a forward-only pass (log-probs, the reference)
    # leaves unsharded copies that later weight edits and exports would not see (the FSDP -> vLLM
    # reshard test caught stale weights), for an 8% CPU saving.
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if prefetch and hf_device.device_type() == "cpu":
        prefetch_async(model, layers)
    return None


def prefetch_async(model, layers: list) -> None:
    """Overlap each layer's parameter all-gather with the previous layer's compute, on CPU.

    On GPU FSDP2 overlaps them by itself: it issues the next all-gather on a side stream. A CPU has
    no streams, so there every unshard runs to completion where it is issued (in the layer's own
    pre-forward / pre-backward) and compute waits for every gather. Issuing the gathers as async
    gloo work (which runs on gloo's own thread) one layer ahead, forward and backward, hides them
    behind the matmuls: 4-16% more tokens/s for a sharded training step at 2 ranks
    (``scripts/bench/engines.py --no-prefetch-too``), the same numbers bit for bit. Gradient
    reduce-scatters stay blocking: FSDP2 reads their output at once (to accumulate micro-batches).
    """
    model._set_unshard_async_op(True)  # private, but the documented switch for this very use
    for i, layer in enumerate(layers):
        if i + 1 < len(layers):
            layer.set_modules_to_forward_prefetch([layers[i + 1]])
        if i > 0:
            layer.set_modules_to_backward_prefetch([layers[i - 1]])
    # the root holds embeddings and heads: it runs first in forward and in backward
    model.set_modules_to_forward_prefetch([layers[0]])
    model.set_modules_to_backward_prefetch([layers[-1]])


@contextlib.contextmanager
def gathered_until_exit(model: torch.nn.Module, enabled: bool):
    """``reshard_after_forward=False``: inside, a layer all-gathered once stays gathered (through
    every micro-batch's forward and backward); on exit every layer is resharded.

    FSDP2's own ``reshard_after_forward=False`` only skips the re-gather between a layer's forward
    and its backward, and leaves forward-only passes holding unsharded copies that later weight
    edits and exports do not see. Here both reshard flags are off only inside the block, and the
    block ends before clipping and the optimizer step, which work on the sharded parameters (while
    gathered, ``model.parameters()`` yields the unsharded tensors, which carry no gradient). The
    gathers are exact copies, so the numbers are the same as with resharding; what changes is one
    all-gather per layer per call instead of two per micro-batch, and a full copy of the
    parameters on every rank while inside.
    """
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)] if enabled else []
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        for m in modules:
            m.set_reshard_after_forward(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)
            m.reshard()


class ReduceAfterBackward:
    """DDP comm hook: hold every gradient bucket until backward has filled the last, then
    all-reduce them one after the other through shared memory (hybridflow/shm_group.py).

    DDP's own hook all-reduces each bucket over gloo as soon as it fills, overlapped with the rest
    of backward; gloo has no shared-memory transport, so its threads copy and sum 4 bytes a
    parameter over TCP loopback on the cores backward runs on: 100 MB (25M parameters) take 72 ms
    and 56 ms of CPU on 2 ranks of a 2-core Xeon, against 24 ms here. What that saves depends on
    the rows a rank trains per step (scripts/bench/engines.py --gloo-too): 1.06-1.20x the step at
    8 rows a rank, nothing measurable at the e2e medium shape's 64. The kernel spins while it
    waits for the slower rank, which is why it runs once, at the end, where ranks of equal work
    arrive together (per bucket, inside backward, it made the update 1.5x slower). The numbers
    are DDP's: each bucket divided by the group's size, then summed (for 2 ranks bit for bit; for
    more, the sum's order is the kernel's, not gloo's ring)."""

    def __init__(self, group):
        self.group, self.world = group, torch.distributed.get_world_size(group)
        self.pending: list = []

    @staticmethod
    def hook(state, bucket):  # no annotations: DDP compares them with its own types, and this module's are strings
        done = torch.futures.Future()
        if bucket.index() == 0:  # a backward that raised part-way left its buckets here
            state.pending = []
        state.pending.append((bucket.buffer(), done))
        if bucket.is_last():
            pending, state.pending = state.pending, []
            for buffer, future in pending:
                buffer.div_(state.world)
                torch.distributed.all_reduce(buffer, group=state.group)
                future.set_result(buffer)
        return done


def compute_context(shard_size: int, param_dtype: str):
    """bf16 autocast in the replicated layout (FSDP2 casts through its MixedPrecisionPolicy)."""
    if shard_size == 1 and param_dtype == "bf16":
        return torch.autocast(hf_device.device_type(), dtype=torch.bfloat16)
    return contextlib.nullcontext()


def accumulation_context(model, ddp, *, shard_size: int, dp_size: int, last: bool):
    """Reduce gradients across replicas only after the last micro-batch of a mini-batch.
    (Sharded FSDP still reduce-scatters each micro-batch: holding unsharded gradients until the
    end would cost the memory sharding saves.)"""
    if last:
        return contextlib.nullcontext()
    if ddp is not None:
        return ddp.no_sync()
    if 1 < shard_size < dp_size:
        return _hsdp_no_all_reduce(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _hsdp_no_all_reduce(model):
    """HSDP: reduce-scatter inside the shard group now, the all-reduce across groups later."""
    model.set_requires_all_reduce(False, recurse=True)
    try:
        yield
    finally:
        model.set_requires_all_reduce(True, recurse=True)
