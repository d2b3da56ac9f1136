"""``fsdp_config.fsdp_size: auto`` (the recipes' default): on a CPU host, replicate (DDP,
``fsdp_size=1``) when every FSDP role's whole training state fits easily in host memory; else,
and on a GPU, shard over all workers (``-1``, which is what verl's default means).

Why the default differs from verl's: on CPU, sharding buys memory and costs time. Each layer's
parameters are all-gathered in forward and again in backward, and its gradients reduce-scattered,
over gloo; a replicated layout sends one all-reduce of the gradients per optimizer step, overlapped
with backward (and fewer bytes: 2P against 3P per rank). On the e2e bench's medium model (25M
parameters, 2 workers) a GRPO step took 1.27 s replicated against 1.67 s sharded
(docs/benchmarks.md). On a GPU, auto keeps sharding: device memory is what vLLM's KV cache and
larger batches want, and NCCL makes the gathers cheap.

The rule, per host: the sum over the FSDP roles (actor, reference, critic) of (workers of the role
on a host) x (bytes of one replica) must be at most a quarter of the host's memory (of the cgroup
limit, if lower). A replica is 4 bytes per parameter (fp32 masters), plus 12 for a trained role
(gradient and two Adam moments; LoRA trains few enough to leave out). Parameters are counted from
the checkpoint's safetensors headers; a checkpoint without them shards. The decision is one for
all roles, said once on stderr (config/resolve.py builds the roles of a run and says it), and
``fsdp_size=-1`` or ``1`` set by hand is kept as given.
"""
from __future__ import annotations

import glob
import json
import math
import os
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

AUTO = "auto"
HOST_SHARE = 0.25   # of host memory that replicated training state may take
MASTER_BYTES = 4    # an fp32 parameter
TRAINED_BYTES = 12  # its gradient and AdamW's two moments, all fp32


def checkpoint_parameter_count(path: str | None) -> int | None:
    """Parameters stored in the ``*.safetensors`` files of an HF checkpoint folder (read from the
    headers only), or None when there are none or they cannot be read."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if path and os.path.isdir(path) else []
    total = 0
    for file in files:
        try:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return None
        total += sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")
    return total or None


def host_memory_bytes() -> int:
    """Physical memory, or the cgroup v2 limit of this process when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def replica_bytes(parameters: int, trained: bool, lora: bool) -> int:
    return parameters * (MASTER_BYTES + (TRAINED_BYTES if trained and not lora else 0))


def choose(roles: list[tuple[str, int | None, int]], on_gpu: bool, memory: int) -> tuple[int, str]:
    """``roles``: (name, bytes of one replica or None when unknown, workers on a host). Returns the
    fsdp_size for every auto role and the reason, one line."""
    if on_gpu:
        return -1, "on a GPU the roles shard (device memory is for the KV cache and batches)"
    unknown = [name for name, size, _ in roles if size is None]
    if unknown:
        return -1, f"the size of {', '.join(unknown)} could not be read from safetensors headers"
    need = sum(size * workers for _, size, workers in roles)
    if need <= HOST_SHARE * memory:
        return 1, (f"the replicas take {_size(need)} per host, within a quarter of its {_size(memory)}, and "
                   "replicating is faster on CPU")
    return -1, f"the replicas would take {_size(need)} per host, more than a quarter of its {_size(memory)}"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


class Role(NamedTuple):
    """One role's part in the decision; ``used``: the run builds it (a reference only with KL)."""
    name: str
    strategy: str
    fsdp_config: Any
    model_path: str | None
    trained: bool
    lora: bool
    workers_per_host: int
    used: bool = True


def resolve(roles: list[Role], on_gpu: Callable[[], bool], say: Callable[[str], None]) -> None:
    """Set every ``auto`` fsdp_size of ``roles`` in place; ``say`` the choice and why, if there was
    one to make (``on_gpu`` is asked only when the answer depends on it)."""
    auto = [r for r in roles if r.fsdp_config.fsdp_size == AUTO]
    for role in auto:
        if role.strategy != "fsdp":  # megatron reads no fsdp_size; -1 is what validation expects there
            role.fsdp_config.fsdp_size = -1
    auto = [r for r in auto if r.strategy == "fsdp"]
    if not auto:
        return
    live = [r for r in auto if r.used]
    offloaded = [r.name for r in live if r.fsdp_config.param_offload or r.fsdp_config.optimizer_offload]
    if max((r.workers_per_host for r in live), default=1) == 1:  # one worker per role: nothing to shard or replicate
        size, why = -1, ""
    elif offloaded:
        size, why = -1, f"{', '.join(offloaded)} offload to host memory, which needs sharded parameters"
    else:
        sizes = []
        for r in live:
            count = checkpoint_parameter_count(r.model_path)
            sizes.append((r.name, None if count is None else replica_bytes(count, r.trained, r.lora),
                          r.workers_per_host))
        size, why = choose(sizes, on_gpu(), host_memory_bytes())
    for role in auto:
        role.fsdp_config.fsdp_size = size
    if why:
        layout = "1 (replicated, DDP)" if size == 1 else "-1 (sharded over all workers)"
        say(f"fsdp_size=auto -> {layout}: {why}. Set fsdp_config.fsdp_size explicitly (-1 | 1 | k) to choose.")
