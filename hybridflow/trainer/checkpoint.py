"""Checkpoint folders of a run and the rules that make resuming safe.

Layout under ``trainer.default_local_dir``::

    global_step_N/
        actor/                 the actor engine's sharded state (engine-specific files), the
                               workers' RNG files ``worker_rng_rank{r}.pt``, ``engine.json`` and
                               ``huggingface/`` (config + tokenizer, for the HF export;
                               with verl's ``checkpoint.save_contents`` hf_model, the whole
                               HF checkpoint: transformers loads it as is)
        critic/                the same for the critic, when there is one
        trainer_state.pt       step, data-loader position, KL controller, controller RNG
        manifest.json          every file above with its size, and the worker layout; written
                               after all of them
    latest_checkpointed_iteration.txt   the tracker: N of the newest complete checkpoint

Two files are written last, each atomically (temp file, fsync, rename): the manifest completes a
folder, the tracker then names it. A crash anywhere in a save leaves the previous checkpoint as
"latest"; a folder without a manifest, or whose files do not match it (deleted, truncated), is
refused with an error naming the folder and the way out, never loaded half.

This module is the controller's side; each role folder is written inside its workers by
``workers/checkpoint.py``. The names both use are in ``hybridflow/checkpoint_files.py``.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil

import numpy as np
import torch

from hybridflow.checkpoint_files import (  # noqa: F401 (re-exported: the trainer's checkpoint API)
    HF_META_DIR, TRACKER, CheckpointError, read_tracker, step_dir, write_atomically, write_tracker,
)

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
FORMAT_VERSION = 1


def write_manifest(path: str, step: int, layout: dict) -> None:
    """Record every file under ``path`` with its size, and the worker ``layout``; marks the folder complete."""
    files = {}
    for folder, _, names in os.walk(path):
        for name in names:
            full = os.path.join(folder, name)
            rel = os.path.relpath(full, path)
            if rel != MANIFEST and not name.endswith(".tmp"):
                files[rel] = os.path.getsize(full)
    manifest = {"format": FORMAT_VERSION, "step": step, "layout": layout, "files": dict(sorted(files.items()))}
    write_atomically(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1))


def check_complete(path: str) -> dict:
    """The manifest of checkpoint folder ``path`` after checking every file it lists; raises
    CheckpointError naming what is wrong and how to resume instead."""
    way_out = ("resume from an earlier global_step_* folder with trainer.resume_mode=<folder>, or start over "
               "with trainer.resume_mode=disable")
    manifest_file = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint folder {path} does not exist: {way_out}")
    if not os.path.exists(manifest_file):
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MANIFEST}: the save did not finish): {way_out}")
    try:
        with open(manifest_file) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({err}): {way_out}") from err
    missing = [rel for rel in files if not os.path.exists(os.path.join(path, rel))]
    resized = [rel for rel, size in files.items()
               if rel not in missing and os.path.getsize(os.path.join(path, rel)) != size]
    if TRAINER_STATE not in files:
        missing.append(TRAINER_STATE)
    if missing or resized:
        raise CheckpointError(f"checkpoint {path} is damaged: missing {sorted(missing)[:5]}, size changed "
                              f"{sorted(resized)[:5]}: {way_out}")
    return manifest


def find_resume_dir(root: str, resume_mode: str) -> str | None:
    """The checkpoint folder to resume from, or None. ``resume_mode``: auto | disable | a path (a
    global_step_N folder, or a run's folder: the latest checkpoint its tracker names)."""
    if resume_mode == "disable":
        return None
    if resume_mode != "auto":
        if not os.path.exists(os.path.join(resume_mode, MANIFEST)) and read_tracker(resume_mode) is not None:
            return find_resume_dir(resume_mode, "auto")  # a run's folder: its latest checkpoint
        check_complete(resume_mode)
        return resume_mode
    step = read_tracker(root)
    if step is None:
        return None
    path = step_dir(root, step)
    check_complete(path)
    return path


def lora_layout(model) -> dict:
    """A model section's LoRA settings, for a role's layout: the checkpoint's tensors are the base
    weights and adapters of that rank and placement, and the scaling alpha/rank is applied on load,
    so resuming with other values fails deep in the optimizer state or silently changes the model.
    Empty without LoRA (layouts saved before this key existed stay comparable)."""
    from hybridflow.config.derived import lora_kwargs

    return lora_kwargs(model) if model.lora_rank else {}


def check_layout(path: str, saved: dict, current: dict) -> None:
    """Refuse to resume when the worker layout differs: each rank's files (optimizer shards,
    per-rank RNG streams) belong to one rank of one layout, so loading them elsewhere would be
    silently wrong or fail deep inside an engine."""
    if saved and current and not set(saved) & set(current):
        raise CheckpointError(f"checkpoint {path} was saved by another recipe (roles {sorted(saved)}; this run trains "
                              f"{sorted(current)}): use another trainer.default_local_dir, or "
                              "trainer.resume_mode=disable to start afresh there")
    diffs = [f"{role}.{key}: saved {saved.get(role, {}).get(key)!r}, now {current.get(role, {}).get(key)!r}"
             for role in sorted(set(saved) | set(current))
             for key in sorted(set(saved.get(role, {})) | set(current.get(role, {})))
             if saved.get(role, {}).get(key) != current.get(role, {}).get(key)]
    if diffs:
        raise CheckpointError(f"checkpoint {path} was saved with another worker layout ({'; '.join(diffs)}): resume "
                              f"with the saved settings (trainer.nnodes, trainer.n_gpus_per_node, parallel sizes, "
                              f"LoRA keys), "
                              f"or export it with `python scripts/export_hf.py` and start a new run from the export")


def start_save(root: str, step: int) -> str:
    """A fresh, empty ``global_step_N`` folder (a partial one left by a crashed save is removed)."""
    path = step_dir(root, step)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def finish_save(root: str, step: int, trainer_state: dict, layout: dict, keep: int | None) -> str:
    """After the roles' folders are written: the trainer state (plus the controller RNG), the
    manifest that completes the folder, the tracker that names it, then pruning. Returns the folder."""
    path = step_dir(root, step)
    torch.save({"global_step": step, **trainer_state, "rng": controller_rng_state()},
               os.path.join(path, TRAINER_STATE))
    write_manifest(path, step, layout)
    write_tracker(root, step)
    prune(root, keep)
    return path


def open_resume(root: str, resume_mode: str, layout: dict) -> tuple[str, dict] | None:
    """(folder, trainer state) to resume from after checking it is complete and saved with this
    worker ``layout``; None when there is nothing to resume."""
    path = find_resume_dir(root, resume_mode)
    if path is None:
        return None
    manifest = check_complete(path)
    check_layout(path, manifest["layout"], layout)
    return path, torch.load(os.path.join(path, TRAINER_STATE), weights_only=False)


def controller_rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_controller_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def folders_to_keep(max_actor: int | None, max_critic: int | None, has_critic: bool) -> int | None:
    """How many global_step_N folders ``prune`` keeps (None: all), from verl's
    ``trainer.max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep``. verl prunes each role's
    checkpoints on its own; here one folder holds both roles, so a folder is deleted with both
    inside, and the smaller limit wins: keeping more folders would keep more checkpoints of that
    role than its limit allows (typically a disk quota), keeping fewer breaks neither limit. The
    critic's limit counts only when the run trains a critic."""
    limits = [k for k in (max_actor, max_critic if has_critic else None) if k is not None]
    return min(limits) if limits else None


def prune(root: str, keep: int | None) -> list[int]:
    """Delete the oldest global_step_* folders beyond the newest ``keep`` (None or <= 0 keeps all);
    the folder the tracker names is never deleted. Returns the deleted steps."""
    if not keep or keep <= 0:
        return []
    latest = read_tracker(root)
    steps = sorted(int(m.group(1)) for d in os.listdir(root) if (m := STEP_DIR.match(d)))
    doomed = [s for s in steps[:-keep] if s != latest]
    for step in doomed:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
    return doomed
