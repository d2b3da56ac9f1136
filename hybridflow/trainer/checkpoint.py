"""Checkpoint folders of a run: ``global_step_N/{actor,critic}/`` (each engine's sharded state),
``global_step_N/trainer_state.pt`` (step, data-loader position, KL controller, controller RNG),
and a tracker file naming the latest *complete* checkpoint.

The tracker is written last and atomically (write a temp file, fsync, rename), so a crash in the
middle of a save leaves the previous checkpoint as "latest", never a broken one.
"""
from __future__ import annotations

import os
import random
import re
import shutil

import numpy as np
import torch

TRACKER = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def write_tracker(root: str, step: int) -> None:
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))


def find_resume_dir(root: str, resume_mode: str) -> str | None:
    """The checkpoint folder to resume from, or None. ``resume_mode``: auto | disable | a path."""
    if resume_mode == "disable":
        return None
    if resume_mode != "auto":
        path = resume_mode
        if not os.path.isdir(path):
            raise FileNotFoundError(f"trainer.resume_mode={path!r}: no such checkpoint folder")
        check_complete(path)
        return path
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker} is corrupted (holds {text!r}); fix it or set trainer.resume_mode=disable")
    path = step_dir(root, int(text))
    check_complete(path)
    return path


def check_complete(path: str) -> None:
    state = os.path.join(path, "trainer_state.pt")
    if not os.path.exists(state) or not os.path.isdir(os.path.join(path, "actor")):
        raise ValueError(f"checkpoint {path} is incomplete (missing trainer_state.pt or actor/); resume from an "
                         f"earlier global_step_* folder with trainer.resume_mode=<path> or set resume_mode=disable")


def controller_rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_controller_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def prune(root: str, keep: int | None) -> None:
    """Delete the oldest global_step_* folders beyond ``keep`` (None or <= 0 keeps all)."""
    if not keep or keep <= 0:
        return
    steps = sorted(int(m.group(1)) for d in os.listdir(root) if (m := STEP_DIR.match(d)))
    for step in steps[:-keep]:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
