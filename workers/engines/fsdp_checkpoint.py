"""Sharded checkpoints of the FSDP engine: model + optimizer through torch.distributed.checkpoint
(one shard file per rank under ``path/dcp``, reshardable by DCP, read back with no pickle that could
run code: ``dcp_reader.py``), and each rank's scheduler and RNG state beside it
(``path/extra_rank{r}.pt``, tensors and numbers only, loaded with ``weights_only=True``)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from hybridflow import device as hf_device
from hybridflow.checkpoint_files import load_tensors
from workers.engines.dcp_reader import SafeLoadPlanner, safe_reader
from workers.engines.optim import load_scheduler_state


def _state(model, optimizer) -> dict:
    if optimizer is None:  # the frozen reference
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_sharded(path: str, model, optimizer, scheduler, rank: int, world_size: int) -> None:
    """A collective: every rank calls it with its own shards on the device."""
    os.makedirs(path, exist_ok=True)
    dcp.save(_state(model, optimizer), checkpoint_id=os.path.join(path, "dcp"))
    extra = {"rng": hf_device.rng_state(), "world_size": world_size,
             "scheduler": scheduler.state_dict() if scheduler is not None else None}
    torch.save(extra, os.path.join(path, f"extra_rank{rank}.pt"))
    dist.barrier()


def check_sharded(path: str, rank: int) -> None:
    """Fails before any collective when this rank's files are missing (a wrong folder, or a
    checkpoint written by fewer ranks)."""
    if not os.path.isdir(os.path.join(path, "dcp")) or not os.path.exists(os.path.join(path, f"extra_rank{rank}.pt")):
        raise FileNotFoundError(f"FSDPEngine.load_checkpoint: {path} has no dcp/ folder or no "
                                f"extra_rank{rank}.pt; pass a folder written by save_checkpoint "
                                "with the same number of ranks")


def load_model_and_optimizer(path: str, model, optimizer) -> None:
    state = _state(model, optimizer)
    dcp.load(state, storage_reader=safe_reader(os.path.join(path, "dcp")), planner=SafeLoadPlanner())
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_rank_state(path: str, scheduler, rank: int) -> None:
    """The scheduler's position and the RNG streams, restored after the weights."""
    extra = load_tensors(os.path.join(path, f"extra_rank{rank}.pt"))
    if scheduler is not None and extra["scheduler"] is not None:
        load_scheduler_state(scheduler, extra["scheduler"])
    hf_device.set_rng_state(extra["rng"])
