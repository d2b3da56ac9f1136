"""The run's paths and devices against the machine it starts on: a file or model folder that is not
there, an output folder that takes no files, more workers than slots, no GPU. Checks of the world,
not of the config's own consistency; both recipes' validate calls them before Ray starts, so a bad
path or a missing GPU fails in a second. Nothing here imports ``hybridflow.config`` (it is called
from there: the import graph runs one way)."""
from __future__ import annotations

import os
import re
import tempfile


# the demo assets under data/ and the command that builds each (the tool demo's: recipes/demo_tools.py)
DEMO_BUILDERS = (("/data/tool_arithmetic/", "python -m recipes.demo_tools"),
                 ("/data/models/tiny-llama-chat-", "python -m recipes.demo_tools"),
                 ("/data/", "make run"))


def demo_build_hint(path: str) -> str:
    """`` (<command> builds the demo data and model)`` for a demo asset's path, else ''."""
    command = next((cmd for part, cmd in DEMO_BUILDERS if part in path), None)
    return f" (`{command}` builds the demo data and model)" if command else ""


def path_error(key: str, path: str | None, kind: str) -> str | None:
    """Why ``path`` is not an existing ``kind`` ("file" or "dir"), as an error naming ``key``; None
    also when it is unset (None)."""
    if path is None or (os.path.isdir(path) if kind == "dir" else os.path.isfile(path)):
        return None
    return (f"{key}: {path} is not an existing {'directory' if kind == 'dir' else 'file'}"
            f": fix the path{demo_build_hint(path)}"
            f"{hub_id_hint(path) if kind == 'dir' else ''}")


def data_file_errors(data) -> list[str]:
    """``data.train_files`` (one at least) and ``data.val_files`` of either recipe, each an existing file."""
    errors = [] if data.train_files else ["data.train_files is empty: give at least one parquet/jsonl file"]
    for key in ("train_files", "val_files"):
        errors += [path_error(f"data.{key}[{i}]", path, "file") for i, path in enumerate(getattr(data, key))]
    return [e for e in errors if e]


def output_folder_errors(trainer, keys) -> list[str]:
    """The output folders of ``trainer`` that ``keys`` name, created and written to now: a bad one fails
    before Ray. The run's own folder (default_local_dir) is left as it was: a check must not create it."""
    errors = []
    for key in keys:
        folder = getattr(trainer, key)
        problem = folder is not None and writable_folder_error(folder, keep=key != "default_local_dir")
        if problem:
            fix = "a writable folder" if key == "default_local_dir" else "a writable folder or null"
            errors.append(f"trainer.{key}: cannot write to {folder} ({problem}): use {fix}")
    return errors


def device_errors(trainer, ray_address: str | None, available_slots: int | None,
                  pools: list[tuple[str, int]] = ()) -> list[str]:
    """More workers than the cluster's slots (or this node's GPUs), or trainer.device=cuda without a GPU.
    ``pools``: (key, workers) of the pools beyond the trainer's (the RL recipe's separate and reward pools)."""
    t, errors = trainer, []
    d_world = t.nnodes * t.n_gpus_per_node
    aux = sum(size for _, size in pools)
    if available_slots is not None and d_world + aux > available_slots:
        parts = f"trainer.nnodes*trainer.n_gpus_per_node={t.nnodes}*{t.n_gpus_per_node}"
        parts += "".join(f" + {key}={size}" for key, size in pools if size)
        fix = "lower trainer.n_gpus_per_node or add devices"
        from hybridflow.device import uses_gpu

        if not uses_gpu(t.device):  # a CPU slot is trainer.cpus_per_worker cores
            share = int(100 * available_slots * t.cpus_per_worker / (d_world + aux)) / 100
            if share > 0:
                fix += f", or share the cores: trainer.cpus_per_worker={share:g}"
        errors.append(f"the run needs {d_world + aux} workers ({parts}) but only {available_slots} "
                      f"slots are available: {fix}")
    if t.device == "cuda":
        from hybridflow.device import device_count

        gpus = device_count()
        if gpus == 0:
            errors.append("trainer.device=cuda but no GPU is visible: use trainer.device=auto or cpu")
        elif t.nnodes == 1 and ray_address is None and d_world + aux > gpus:
            errors.append(f"trainer.n_gpus_per_node={t.n_gpus_per_node} (+ separate pools {aux}) "
                          f"exceeds the {gpus} GPUs visible on this node: lower it")
    return errors


def hub_id_hint(path: str, base_dir: str | None = None) -> str:
    """For a missing model folder that was given as ``org/name`` (made absolute against the working
    directory on load): models are read from local folders only, so say how to get one."""
    relative = os.path.relpath(path, base_dir or os.getcwd())
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", relative):
        return ""
    return (f"; if '{relative}' is a Hugging Face Hub id, download it first (`hf download "
            f"{relative} --local-dir <folder>`) and pass that folder")


def writable_folder_error(folder: str, keep: bool = True) -> str | None:
    """None when ``folder`` exists (it is created) and takes new files, else why not. Run before
    Ray starts, so a bad folder fails in a second, not after the first step's work. ``keep=False``
    removes again the folders the check created."""
    created, parent = [], os.path.abspath(folder)
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        created.append(parent)
        parent = os.path.dirname(parent)
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()  # a nameless file: nothing is left behind
    except OSError as err:
        return err.strerror or str(err)
    finally:
        for path in created if not keep else ():  # deepest first; only the empty folders made here
            try:
                os.rmdir(path)
            except OSError:
                break
    return None
