"""A worker's part of a checkpoint, called inside each worker process by the actor, critic and SFT
workers' ``save_checkpoint`` / ``load_checkpoint``: the engine's sharded state, this rank's RNG
and, from rank 0, the engine metadata the HF export reads (``engine.json`` and ``huggingface/``).
The folder around it (step folders, manifest, tracker) is the trainer's:
``hybridflow/trainer/checkpoint.py``.
"""
from __future__ import annotations

import json
import os

import torch

from hybridflow import device
from hybridflow.checkpoint_files import (ENGINE_META, HF_META_DIR, WORKER_RNG, CheckpointError, load_tensors,
                                         plain_rng_state, set_plain_rng_state, write_atomically)
from workers.engines.hf_export import copy_tokenizer_files


def save_worker_rng(path: str, rank: int, rollout_streams=None) -> None:
    """This rank's RNG: python, numpy and torch (the training stream; on GPU the device's too) and,
    on rollout ranks, the generation stream. vLLM's CPU sampler draws its noise from the
    process's global torch generator, which RNGStreams swaps in for generation, so the generation
    stream is the whole sampling state: restoring it restores the sampled tokens. Plain ints,
    lists and tensors only: ``load_worker_rng`` reads it with ``weights_only=True``."""
    state = {**plain_rng_state(), "torch": device.rng_state(),
             "rollout": rollout_streams.state_dict() if rollout_streams is not None else None}
    torch.save(state, os.path.join(path, WORKER_RNG.format(rank=rank)))


def load_worker_rng(path: str, rank: int, rollout_streams=None) -> None:
    file = os.path.join(path, WORKER_RNG.format(rank=rank))
    if not os.path.exists(file):
        raise CheckpointError(f"{file} is missing: the checkpoint was saved by fewer workers or is damaged")
    state = load_tensors(file)
    set_plain_rng_state(state)
    device.set_rng_state(state["torch"])
    if rollout_streams is not None and state["rollout"] is not None:
        rollout_streams.load_state_dict(state["rollout"])


def save_engine_meta(engine, path: str, world_size: int) -> None:
    """``engine.json`` (strategy, parallel sizes, role) and ``huggingface/`` (config.json naming the
    HF class, tokenizer files): what the HF export needs besides the weight shards. Rank 0 only."""
    strategy = engine.config.strategy
    if strategy == "megatron":
        architecture = engine._hf_architecture()
        hf_config = engine.hf_config
        if engine.role == "critic":
            hf_config = type(hf_config).from_dict({**hf_config.to_dict(), "num_labels": 1})
    else:
        architecture, hf_config = engine.architecture, engine.hf_config
    meta = {"strategy": strategy, "role": engine.role, "world_size": world_size,
            "tp": getattr(engine, "tp", 1), "pp": getattr(engine, "pp", 1), "architecture": architecture,
            "source_model": engine.model_path,
            # LoRA: the checkpoint holds each adapted weight's base and adapters; export merges them
            "lora_scalings": dict(getattr(engine, "lora_scalings", None) or {})}
    hf_dir = os.path.join(path, HF_META_DIR)
    os.makedirs(hf_dir, exist_ok=True)
    hf_config = type(hf_config).from_dict(hf_config.to_dict())
    hf_config.architectures = [architecture]
    hf_config.save_pretrained(hf_dir)
    copy_tokenizer_files(engine.model_path, hf_dir)
    write_atomically(os.path.join(path, ENGINE_META), json.dumps(meta, indent=1))


def save_worker_checkpoint(engine, path: str, rank: int, world_size: int, rollout_streams=None) -> None:
    """One role's folder: the engine's sharded state, this rank's RNG and, from rank 0, the
    engine metadata the HF export reads."""
    engine.save_checkpoint(path)
    save_worker_rng(path, rank, rollout_streams)
    if rank == 0:
        save_engine_meta(engine, path, world_size)


def load_worker_checkpoint(engine, path: str, rank: int, rollout_streams=None) -> None:
    engine.load_checkpoint(path)
    load_worker_rng(path, rank, rollout_streams)
