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

import hashlib
import os
import pickle
import random
import zipfile

import numpy as np

TRACKER = "latest_checkpointed_iteration.txt"
WORKER_RNG = "worker_rng_rank{rank}.pt"
ENGINE_META = "engine.json"
HF_META_DIR = "huggingface"


# how every "this checkpoint cannot be read" message ends
WAY_OUT = ("resume from an earlier global_step_* folder with trainer.resume_mode=<folder>, or start over "
           "with trainer.resume_mode=disable")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (corrupted, partial, or another worker layout)."""


class CheckpointSaveError(RuntimeError):
    """A save that failed (a full disk, a lost mount): its partial folder is gone, the tracker still
    names the previous checkpoint."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
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


def file_digest(path: str) -> str:
    """sha256 of a file's bytes, streamed: the manifest's proof that a file is the one the save
    wrote. sha256 over blake2b: CPUs with SHA extensions hash it faster (812 vs 598 MiB/s here; the
    cost per checkpoint is in docs/contracts.md: Checkpoints)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# What a torch.load(weights_only=True) of a damaged or crafted file raises: its restricted
# unpickler refuses any global outside torch's allow-list (no code runs), a torn zip fails to open.
UNREADABLE = (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, KeyError, AttributeError,
              IndexError, zipfile.BadZipFile, UnicodeDecodeError)


def load_tensors(file: str, **kwargs):
    """A checkpoint's ``.pt`` file: dicts, lists, numbers and tensors only (``weights_only=True``:
    nothing in the file can name a function to call). Anything else is a CheckpointError."""
    import torch

    try:
        return torch.load(file, weights_only=True, **kwargs)
    except UNREADABLE as err:
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
        raise CheckpointError(f"{file} is not a checkpoint file this version can read ({type(err).__name__}: "
                              f"{first}): {WAY_OUT}") from err


def plain_rng_state() -> dict:
    """python's and numpy's global RNG as plain ints and lists, which ``load_tensors`` and JSON
    accept (numpy's own state holds an ndarray, which would need a pickled class)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, gauss_next = random.getstate()
    return {"python": [version, list(words), gauss_next],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}


def set_plain_rng_state(state: dict) -> None:
    version, words, gauss_next = state["python"]
    random.setstate((version, tuple(words), gauss_next))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
