"""Turn a saved actor (or critic) into an ordinary HF checkpoint:

    python scripts/export_hf.py <checkpoint> <out_dir> [--role actor|critic] [--external-lib MODULE]

``<checkpoint>`` is a role folder (``.../global_step_N/actor``), a ``global_step_N`` folder, or a
run's ``default_local_dir`` (its latest complete checkpoint). The output is ``model.safetensors`` +
``config.json`` + tokenizer files, which transformers and vLLM load.

Unlike the engines' ``save_hf`` this needs no process group and not the saved cluster shape: the
sharded files are read directly in this one process.
- FSDP (torch.distributed.checkpoint): the model entries of the DCP folder are loaded whole with
  ``no_dist=True`` (DCP stitches the per-rank shards from its metadata); the optimizer entries are
  never read.
- Megatron (``megatron/tp{t}_pp{p}.pt``, any tp/pp): each stage's TP shards are joined per tensor
  with the same ``layout.param_specs`` table that the engine's loader and ``save_hf`` use, fused
  QKV and gate/up split back into HF's separate tensors. Files are memory-mapped, so optimizer
  state in them is not read into memory.
The HF config and tokenizer come from ``huggingface/`` inside the checkpoint, written at save time,
so the export does not depend on the original model folder still existing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Iterator

import torch
from torch import Tensor

from hybridflow import checkpoint_files as ckpt
from hybridflow.model_overrides import external_lib_error
from workers.engines.hf_export import write_hf_checkpoint
from workers.engines.lora import merge_lora
from workers.models.convert import VALUE_HEAD, shards_to_hf
from workers.models.layout import ModelDims, param_specs


class ExportError(ValueError):
    pass


def resolve_role_dir(path: str, role: str = "actor") -> str:
    """The folder holding ``engine.json`` for ``path`` (role folder, global_step folder, or run root)."""
    if os.path.exists(os.path.join(path, ckpt.ENGINE_META)):
        return path
    if os.path.exists(os.path.join(path, role, ckpt.ENGINE_META)):
        return os.path.join(path, role)
    step = ckpt.read_tracker(path) if os.path.isdir(path) else None
    if step is not None:
        return resolve_role_dir(ckpt.step_dir(path, step), role)
    saved = sorted(r for r in ("actor", "critic") if os.path.exists(os.path.join(path, r, ckpt.ENGINE_META)))
    if saved:
        raise ExportError(f"{path} holds no {role} checkpoint (saved roles: {', '.join(saved)}): the run trained "
                          f"no {role}; pass --role {saved[0]}")
    raise ExportError(f"{path} is not a checkpoint: pass a global_step_N folder, its {role}/ folder, or a run's "
                      f"trainer.default_local_dir (no {ckpt.ENGINE_META} found; checkpoints written before it existed "
                      f"can be exported with the engine's save_hf)")


def fsdp_tensors(role_dir: str, tied: bool, lora_scalings: dict[str, float]) -> Iterator[tuple[str, Tensor]]:
    """HF-named full tensors from the FSDP engine's DCP folder (model entries only), LoRA adapters
    merged into their weights as the engine's own export does."""
    import torch.distributed.checkpoint as dcp

    from workers.engines.dcp_reader import SafeLoadPlanner, safe_reader

    reader = safe_reader(os.path.join(role_dir, "dcp"))
    metadata = reader.read_metadata()
    model = {key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and hasattr(meta, "size")}
    if not model:
        raise ExportError(f"{role_dir}/dcp holds no model tensors: is it an FSDP engine checkpoint?")
    if any(".lora_" in key for key in model) and not lora_scalings:
        raise ExportError(f"{role_dir} holds LoRA adapters but its {ckpt.ENGINE_META} has no lora_scalings (saved "
                          "before export could merge them): export it with the engine's save_hf instead")
    state = {"model": model}
    with warnings.catch_warnings():  # it warns that it loads in one process: what no_dist asks for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    for name, tensor in merge_lora(state["model"].items(), lora_scalings):
        if tied and name == "lm_head.weight":  # HF checkpoints of tied models leave the alias out
            continue
        yield name, tensor


def megatron_tensors(role_dir: str, hf_config, meta: dict) -> Iterator[tuple[str, Tensor]]:
    """HF-named full tensors from the Megatron engine's per-(tp, pp) files."""
    folder = os.path.join(role_dir, "megatron")
    with open(os.path.join(folder, "layout.json")) as f:
        layout = json.load(f)
    tp, pp = layout["tp"], layout["pp"]
    dims = ModelDims.from_hf(hf_config)
    critic = meta["role"] == "critic"
    for stage in range(pp):
        shards = []
        for t in range(tp):
            file = os.path.join(folder, f"tp{t}_pp{stage}.pt")
            if not os.path.exists(file):
                raise ExportError(f"{file} is missing: a tp={tp}, pp={pp} checkpoint needs one file per (tp, pp) rank")
            shards.append(ckpt.load_tensors(file, map_location="cpu", mmap=True)["model"])
        for spec in param_specs(dims, tp, pp, stage):
            if critic and spec.name == "output_layer.weight":
                continue
            parts = [s[spec.name] for s in shards] if spec.split_dim is not None else [shards[0][spec.name]]
            for name, tensor in shards_to_hf(spec, parts, dims):
                yield name, tensor.clone()
        if critic and stage == pp - 1:
            for name in VALUE_HEAD:
                yield name, shards[0][name].clone()


def export(checkpoint: str, out_dir: str, role: str | None = None) -> str:
    """Write the HF checkpoint of ``role`` saved under ``checkpoint`` into ``out_dir``; returns out_dir.
    ``role=None``: the role folder given, or the actor of a step folder or run."""
    from transformers import AutoConfig

    role_dir = resolve_role_dir(checkpoint, role or "actor")
    with open(os.path.join(role_dir, ckpt.ENGINE_META)) as f:
        meta = json.load(f)
    if role is not None and meta.get("role", role) != role:
        raise ExportError(f"{role_dir} is the {meta['role']}'s checkpoint, not the {role}'s: pass --role "
                          f"{meta['role']}, or the global_step_N folder that holds both")
    hf_dir = os.path.join(role_dir, ckpt.HF_META_DIR)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    if meta["strategy"] == "fsdp":
        tensors = fsdp_tensors(role_dir, bool(getattr(hf_config, "tie_word_embeddings", False)),
                               meta.get("lora_scalings") or {})
    elif meta["strategy"] == "megatron":
        tensors = megatron_tensors(role_dir, hf_config, meta)
    else:
        raise ExportError(f"{role_dir}/{ckpt.ENGINE_META} names strategy {meta['strategy']!r}; "
                          "export knows fsdp and megatron")
    write_hf_checkpoint(out_dir, tensors, hf_config, meta["architecture"], source_dir=hf_dir)
    return out_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/export_hf.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="global_step_N folder, its actor/ or critic/ folder, or a run folder")
    parser.add_argument("out_dir", help="where to write the HF checkpoint")
    parser.add_argument("--role", default=None, choices=("actor", "critic"),
                        help="which role of a global_step_N folder or run (default: actor, or the role folder given)")
    parser.add_argument("--external-lib", help="module to import first (the run's model.external_lib, for a "
                        "model type it registers with transformers)")
    args = parser.parse_args(argv)
    error = external_lib_error("--external-lib", args.external_lib)
    if error:
        print(f"export error: {error}", file=sys.stderr)
        return 2
    try:
        out = export(args.checkpoint, args.out_dir, args.role)
    except (ExportError, ckpt.CheckpointError) as err:
        print(f"export error: {err}", file=sys.stderr)
        return 2
    print(f"HF checkpoint written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
