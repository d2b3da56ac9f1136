"""Checkpoint folders of a run and the rules that make resuming safe.

Layout under ``trainer.default_local_dir``::

    global_step_N/
        actor/                 the actor engine's sharded state (engine-specific files), the
                               workers' RNG files ``worker_rng_rank{r}.pt``, ``engine.json`` and
                               ``huggingface/`` (config + tokenizer, for the HF export;
                               with verl's ``checkpoint.save_contents`` hf_model, the whole
                               HF checkpoint: transformers loads it as is)
        critic/                the same for the critic, when there is one
        trainer_state.json     step, data-loader position, KL controller, controller RNG (JSON:
                               it carries no code, see docs/contracts.md: Checkpoints)
        manifest.json          every file above with its size and sha256 hash, and the worker
                               layout; written after all of them
    latest_checkpointed_iteration.txt   the tracker: N of the newest complete checkpoint

Two files are written last, each atomically (temp file, fsync, rename): the manifest completes a
folder, the tracker then names it. A crash anywhere in a save leaves the previous checkpoint as
"latest"; a folder without a manifest, or whose files do not match it (deleted, truncated, bytes
changed), is refused with an error naming the folder and the way out, never loaded half. Without a
tracker (deleted), ``resume_mode=auto`` resumes from the newest folder that verifies, and says so.

This module is the controller's side; each role folder is written inside its workers by
``workers/checkpoint.py``. The names both use are in ``hybridflow/checkpoint_files.py``.
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import sys
from contextlib import contextmanager

import torch

from hybridflow.checkpoint_files import (  # noqa: F401 (re-exported: the trainer's checkpoint API)
    HF_META_DIR, TRACKER, WAY_OUT, CheckpointError, CheckpointSaveError, file_digest, plain_rng_state, read_tracker,
    set_plain_rng_state, step_dir, write_atomically, write_tracker,
)

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
# 2: trainer_state.json instead of a pickled trainer_state.pt, RNG files without numpy objects,
# a sha256 hash per file in the manifest
FORMAT_VERSION = 2


def write_manifest(path: str, step: int, layout: dict) -> None:
    """Record every file under ``path`` with its size and hash, and the worker ``layout``; marks the
    folder complete."""
    files = {}
    for folder, _, names in os.walk(path):
        for name in names:
            full = os.path.join(folder, name)
            rel = os.path.relpath(full, path)
            if rel != MANIFEST and not name.endswith(".tmp"):
                files[rel] = {"size": os.path.getsize(full), "sha256": file_digest(full)}
    manifest = {"format": FORMAT_VERSION, "step": step, "layout": layout, "files": dict(sorted(files.items()))}
    write_atomically(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1))


def check_complete(path: str) -> dict:
    """The manifest of checkpoint folder ``path`` after checking every file it lists (size, then
    content hash); raises CheckpointError naming what is wrong and how to resume instead."""
    manifest_file = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint folder {path} does not exist: {WAY_OUT}")
    if not os.path.exists(manifest_file):
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MANIFEST}: the save did not finish): {WAY_OUT}")
    try:
        with open(manifest_file) as f:
            manifest = json.load(f)
        files = manifest["files"]
        version = manifest.get("format")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({err}): {WAY_OUT}") from err
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {version!r}; this version reads format "
                              f"{FORMAT_VERSION} only (older checkpoints held pickled state): start over with "
                              f"trainer.resume_mode=disable, or export it with the version that wrote it")
    missing = [rel for rel in files if not os.path.exists(os.path.join(path, rel))]
    if TRAINER_STATE not in files:
        missing.append(TRAINER_STATE)
    resized = [rel for rel, entry in files.items()
               if rel not in missing and os.path.getsize(os.path.join(path, rel)) != entry["size"]]
    if missing or resized:
        raise CheckpointError(f"checkpoint {path} is damaged: missing {sorted(missing)[:5]}, size changed "
                              f"{sorted(resized)[:5]}: {WAY_OUT}")
    # sizes first: they catch a truncated save without reading a byte
    changed = [rel for rel, entry in sorted(files.items()) if _digest(os.path.join(path, rel)) != entry["sha256"]]
    if changed:
        raise CheckpointError(f"checkpoint {path} is damaged: the content of {changed[:5]} changed since it was "
                              f"saved (hash mismatch): {WAY_OUT}")
    return manifest


# sha256 of the files this process has hashed, by (path, inode, size, mtime): a resume checks its
# folder before Ray starts and again in the trainer, each with find_resume_dir then open_resume;
# without this a large checkpoint was read four times. A file written since has another mtime.
_DIGESTS: dict[tuple, str] = {}


def _digest(path: str) -> str:
    st = os.stat(path)
    key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = file_digest(path)
    return _DIGESTS[key]


def saved_steps(root: str) -> list[int]:
    """The N of every global_step_N folder under ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    return sorted((int(m.group(1)) for d in os.listdir(root) if (m := STEP_DIR.match(d))), reverse=True)


def newest_verified(root: str, skip: int | None = None) -> str | None:
    """The newest global_step_N folder under ``root`` that verifies (manifest, sizes, hashes)."""
    for step in saved_steps(root):
        if step == skip:
            continue
        try:
            check_complete(step_dir(root, step))
        except CheckpointError:
            continue
        return step_dir(root, step)
    return None


def _without_tracker(root: str) -> str | None:
    """``resume_mode=auto`` with no tracker: a fresh run when no folder has a manifest (at most a
    first save that never finished), else the newest folder that verifies, said on stderr, so a
    deleted tracker neither restarts the run over its checkpoints nor resumes a damaged one."""
    saved = [s for s in saved_steps(root) if os.path.exists(os.path.join(step_dir(root, s), MANIFEST))]
    if not saved:
        return None
    path = newest_verified(root)
    if path is None:
        raise CheckpointError(f"{root} has no {TRACKER} and none of its checkpoints "
                              f"{[os.path.basename(step_dir(root, s)) for s in saved][:5]} verifies: pass one "
                              f"with trainer.resume_mode=<folder> to see what is wrong with it, or start over "
                              f"with trainer.resume_mode=disable (or another trainer.default_local_dir)")
    if path not in _ANNOUNCED:  # once: the recipe checks before Ray starts, the trainer again after
        _ANNOUNCED.add(path)
        print(f"{root} has no {TRACKER}: resuming from the newest checkpoint that verifies, {path} (to choose "
              f"another, set trainer.resume_mode=<folder>)", file=sys.stderr, flush=True)
    return path


_ANNOUNCED: set[str] = set()


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
        return _without_tracker(root)
    path = step_dir(root, step)
    try:
        check_complete(path)
    except CheckpointError as err:  # name the checkpoint that would work, if there is one
        good = newest_verified(root, skip=step)
        if good is None:
            raise
        raise CheckpointError(f"{err}; the newest checkpoint that verifies is {good}: trainer.resume_mode={good} "
                              "resumes from it") from err
    return path


def remove_partial(root: str, after: int) -> list[int]:
    """Delete the global_step_N folders past step ``after`` that have no manifest: saves that
    never finished (a crash, a full disk), which no resume may use and the next save of that
    step would replace anyway. Returns the removed steps."""
    doomed = [s for s in saved_steps(root)
              if s > after and not os.path.exists(os.path.join(step_dir(root, s), MANIFEST))]
    for step in doomed:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
    return doomed


def lora_layout(model) -> dict:
    """A model section's LoRA settings, for a role's layout: the checkpoint's tensors are the base
    weights and adapters of that rank and placement, and the scaling alpha/rank is applied on load,
    so resuming with other values fails deep in the optimizer state or silently changes the model.
    Empty without LoRA (layouts saved before this key existed stay comparable)."""
    from hybridflow.config.derived import lora_kwargs

    return lora_kwargs(model) if model.lora_rank else {}


def worker_layout(cfg) -> dict:
    """What each saved file's rank means: world sizes and parallel sizes per trained role, from the
    config alone, so a resume into another layout is refused before any worker starts."""
    from hybridflow.config.derived import derive, model_parallel

    d, arr = derive(cfg), cfg.actor_rollout_ref
    tp, pp = model_parallel(arr.actor.strategy, arr.actor.megatron)
    layout = {"actor_rollout_ref": {"world_size": d.actor_world, "strategy": arr.actor.strategy,
                                    "tp": tp, "pp": pp, "rollout_tp": arr.rollout.tensor_model_parallel_size,
                                    **lora_layout(arr.model)}}
    if d.use_critic:
        c = cfg.critic
        ctp, cpp = model_parallel(c.strategy, c.megatron)
        layout["critic"] = {"world_size": d.critic_world, "strategy": c.strategy, "tp": ctp, "pp": cpp,
                              **lora_layout(c.model)}
    return layout


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


@contextmanager
def removed_if_unfinished(path: str):
    """Around a save into ``path``: if it fails before its manifest is written, the partial folder
    is removed (it is no checkpoint, and a full disk should not stay full of it) and an OSError
    anywhere in the cause (ENOSPC, also from a worker) becomes one CheckpointSaveError line."""
    try:
        yield
    except BaseException as err:
        if os.path.exists(os.path.join(path, MANIFEST)):  # complete: pruning or the tracker failed
            raise
        shutil.rmtree(path, ignore_errors=True)
        cause = _os_error_in(err)
        if cause is None:
            raise
        raise CheckpointSaveError(f"could not write checkpoint {path} ({type(cause).__name__}: {cause}); its "
                                  "partial folder was removed: free space under trainer.default_local_dir (or point "
                                  "it elsewhere), then resume") from err


def _os_error_in(err: BaseException | None, depth: int = 0) -> OSError | None:
    """The OSError behind ``err``: itself, its cause or context, or a Ray task error's ``cause``."""
    if err is None or depth > 8:
        return None
    if isinstance(err, OSError):
        return err
    for inner in (getattr(err, "cause", None), err.__cause__, err.__context__):
        if isinstance(inner, BaseException) and (found := _os_error_in(inner, depth + 1)) is not None:
            return found
    return None


def finish_save(root: str, step: int, trainer_state: dict, layout: dict, keep: int | None) -> str:
    """After the roles' folders are written: the trainer state (plus the controller RNG), the
    manifest that completes the folder, the tracker that names it, then pruning. Returns the folder."""
    path = step_dir(root, step)
    write_atomically(os.path.join(path, TRAINER_STATE),
                     json.dumps({"global_step": step, **trainer_state, "rng": controller_rng_state()}))
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
    return path, read_trainer_state(os.path.join(path, TRAINER_STATE))


def read_trainer_state(file: str) -> dict:
    """``trainer_state.json``, parsed as data only; anything else is a CheckpointError."""
    try:
        with open(file, encoding="utf-8") as f:
            state = json.load(f)
        int(state["global_step"])
        rng = state["rng"]
        # the shapes the RNG setters need, checked here so a bad file fails before Ray starts
        if (len(rng["python"][1]) != 625 or len(rng["numpy"][1]) != 624
                or len(base64.b64decode(rng["torch"], validate=True)) != torch.get_rng_state().numel()):
            raise ValueError("the RNG state has the wrong length")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, IndexError) as err:
        raise CheckpointError(f"{file} is not a trainer state ({type(err).__name__}: {err}): {WAY_OUT}") from err
    return state


def controller_rng_state() -> dict:
    """The controller's RNGs as JSON: python/numpy as ints and lists, torch's byte state in base64."""
    return {**plain_rng_state(), "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}


def set_controller_rng_state(state: dict) -> None:
    set_plain_rng_state(state)
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))


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
    steps = sorted(saved_steps(root))
    doomed = [s for s in steps[:-keep] if s != latest]
    for step in doomed:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
    return doomed
