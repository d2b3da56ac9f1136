"""The names and file primitives of a checkpoint folder, shared by the three parts that touch it.

- the trainer writes ``global_step_N/``, ``trainer_state.pt``, the manifest and the tracker
  (``hybridflow/trainer/checkpoint.py``, which documents the whole layout);
- each worker writes its role's shards, RNG file, ``engine.json`` and ``huggingface/``
  (``workers/checkpoint.py``);
- the HF export reads them back in one process (``workers/export.py``).

It sits in the core, below all three, so none of them imports another's layer (DESIGN.md: the
core never imports ``workers``; ``workers`` never imports the trainer).
"""
from __future__ import annotations

import os

TRACKER = "latest_checkpointed_iteration.txt"
WORKER_RNG = "worker_rng_rank{rank}.pt"
ENGINE_META = "engine.json"
HF_META_DIR = "huggingface"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (corrupted, partial, or another worker layout)."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:  # make the rename itself durable
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_tracker(root: str, step: int) -> None:
    write_atomically(os.path.join(root, TRACKER), str(step))


def read_tracker(root: str) -> int | None:
    """The step the tracker names, None without a tracker; garbage is an error, not "no checkpoint"."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker} is corrupted (holds {text[:40]!r}, not a step number): write the step "
                              f"of a complete global_step_* folder into it, or set trainer.resume_mode=<folder> or "
                              f"trainer.resume_mode=disable")
    return int(text)
