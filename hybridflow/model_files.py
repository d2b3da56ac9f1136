"""A model folder's files, read cheaply before Ray: its JSON files parse, every safetensors shard
holds as many bytes as its header says, and its tokenizer files exist and load.

Without these checks a corrupt ``config.json`` ended in a JSON traceback, a truncated
``model.safetensors`` passed and failed a minute later inside a worker, and a folder without
tokenizer files loaded as an empty tokenizer (transformers builds one from ``config.json``), which
was then blamed on data row 0 ("tokenizes to no tokens").
"""
from __future__ import annotations

import glob
import json
import os
import struct

from hybridflow.errors import ConfigError

RESTORE = "copy it again from the model's original folder"

# Any one of these lets transformers build the tokenizer: the fast tokenizer's own file, a
# sentencepiece model (Llama, T5, tiktoken's tokenizer.model), or a slow BPE/WordPiece vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")

# a safetensors file: an 8-byte little-endian header length, that many bytes of JSON, then the data
HEADER_LEN_BYTES = 8
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit


def json_file_error(path: str) -> str | None:
    """Why ``path`` is not a readable JSON file, or None when it is."""
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except json.JSONDecodeError as err:
        return f"{path} is not valid JSON (line {err.lineno} column {err.colno}: {err.msg}): {RESTORE}"
    except UnicodeDecodeError as err:
        return f"{path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}): {RESTORE}"
    except OSError as err:
        return f"{path} cannot be read ({err.strerror}): {RESTORE}"
    return None


def read_json(path: str) -> dict:
    """``path`` as a dict; a file that is not JSON raises one ConfigError line naming it."""
    problem = json_file_error(path)
    if problem:
        raise ConfigError(problem)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def safetensors_error(path: str) -> str | None:
    """Why the shard at ``path`` cannot load, from its header alone (no tensor is read): the
    header must parse and the file must hold every byte its tensors' data_offsets reach."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_LEN_BYTES)
            if len(raw) < HEADER_LEN_BYTES:
                raise ValueError(f"{size} bytes, too short for a header")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > MAX_HEADER_BYTES:
                raise ValueError(f"a header of {header_len} bytes")
            if HEADER_LEN_BYTES + header_len > size:  # cut inside the header: its offsets are lost
                return (f"{path} is truncated: {size} bytes, its header alone needs {HEADER_LEN_BYTES + header_len}: "
                        f"{RESTORE} (an interrupted copy or download leaves this)")
            header = json.loads(f.read(header_len))
        end = max((t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        # JSONDecodeError and UnicodeDecodeError are ValueErrors too: a garbled header
        return f"{path} is not a readable safetensors file ({err}): {RESTORE}"
    expected = HEADER_LEN_BYTES + header_len + end
    if size < expected:
        return (f"{path} is truncated: {size} bytes, its header says {expected}: {RESTORE} "
                "(an interrupted copy or download leaves this)")
    return None


def weight_errors(folder: str) -> list[str]:
    """Every ``*.safetensors`` shard's header against its size, and every shard an index names exists."""
    errors = [e for e in map(safetensors_error, sorted(glob.glob(os.path.join(folder, "*.safetensors")))) if e]
    for index in sorted(glob.glob(os.path.join(folder, "*.safetensors.index.json"))):
        problem = json_file_error(index)
        if problem:
            continue  # json_errors names it
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map") or {}
        missing = sorted({s for s in weight_map.values() if not os.path.isfile(os.path.join(folder, s))})
        if missing:
            errors.append(f"{index} names shards that are not in {folder}: {', '.join(missing)}: {RESTORE}")
    return errors


def json_errors(folder: str) -> list[str]:
    """Every JSON file of the folder (config.json, tokenizer_config.json, tokenizer.json, ...) parses."""
    return [e for e in map(json_file_error, sorted(glob.glob(os.path.join(folder, "*.json")))) if e]


def model_folder_errors(key: str, folder: str | None) -> list[str]:
    """The problems of the model folder ``key`` names, each as ``key: problem``; a missing folder
    is path_errors' to name."""
    if not folder or not os.path.isdir(folder):
        return []
    return [f"{key}: {e}" for e in json_errors(folder) + weight_errors(folder)]


# What the engines load weights from: transformers' from_pretrained (FSDP, the reward model) and
# workers/models/convert.py (Megatron) read safetensors shards or pytorch_model*.bin files
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")
# files of this trainer's checkpoints (and of torch DCP / Megatron dist-checkpointing): such a folder
# holds sharded training state, which the engines do not start from; export it to a model first
CHECKPOINT_MARKERS = ("engine.json", "manifest.json", "latest_checkpointed_iteration.txt", ".metadata",
                      "*.distcp", "global_step_*")


def weights_error(key: str, folder: str | None) -> str | None:
    """Why the model folder ``key`` names holds no weights to start from, or None. Checked where a
    recipe loads weights (its entry point), not by ``validate``: layouts are checked against
    config.json alone, and tests do that with folders holding only config.json."""
    if not folder or not os.path.isdir(folder) or any(glob.glob(os.path.join(folder, p)) for p in WEIGHT_FILES):
        return None  # a missing folder is path_errors' to name
    what = f"{key}: {folder} has no weights (no {', '.join(WEIGHT_FILES)} file)"
    checkpoint = _training_checkpoint(folder)
    if checkpoint:
        return (f"{what}: it belongs to a training checkpoint ({checkpoint}), not a model: export one with "
                f"python scripts/export_hf.py {checkpoint} <out_dir> and set {key}=<out_dir>")
    return (f"{what}: point {key} at an HF model folder (save_pretrained writes model.safetensors), or "
            f"{RESTORE}")


def _training_checkpoint(folder: str) -> str | None:
    """The folder, or the one or two above it (``actor/huggingface`` holds config.json and the
    tokenizer of a checkpoint, without weights), that holds checkpoint files; None if none does."""
    up = os.path.abspath(folder)
    for _ in range(3):
        if any(glob.glob(os.path.join(up, marker)) for marker in CHECKPOINT_MARKERS):
            return up
        up = os.path.dirname(up)
    return None


def tokenizer_files_error(key: str, folder: str) -> str | None:
    if any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES):
        return None
    return (f"{key}: {folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the "
            f"tokenizer files from the model's original folder into it, or set {key.rsplit('.', 1)[0]}"
            ".tokenizer_path to a folder that has them")


def load_model_tokenizer(prefix: str, model):
    """The tokenizer of ``model`` (a config node with ``path`` and ``tokenizer_path``; ``prefix``
    is its key, e.g. ``actor_rollout_ref.model``). A folder without tokenizer files, or whose
    files do not load, raises one ConfigError line naming the folder and the key."""
    from hybridflow.tiny import load_tokenizer

    key = f"{prefix}.tokenizer_path" if model.tokenizer_path else f"{prefix}.path"
    folder = model.tokenizer_path or model.path
    problem = tokenizer_files_error(key, folder) or next(iter(json_errors(folder)), None)
    if problem:
        raise ConfigError(problem if problem.startswith(key) else f"{key}: {problem}")
    try:
        return load_tokenizer(folder)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds; each is this folder's problem
        first_line = (str(err).strip().splitlines() or [""])[0]
        raise ConfigError(f"{key}: the tokenizer in {folder} does not load ({type(err).__name__}: {first_line}): "
                          f"{RESTORE}") from err
