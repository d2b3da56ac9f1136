"""HF checkpoint <-> Megatron stage tensors, driven by ``layout.param_specs``.

Loading reads only the HF tensors a (tp_rank, pp_rank) needs, lazily from safetensors, and slices
them. Export is a collective generator: for each HF tensor, the owning stage gathers its TP shards
and broadcasts the full tensor to every pipeline stage, so every rank yields the same
``(hf_name, full_tensor)`` sequence, one tensor in memory at a time.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from workers.models.layout import ModelDims, ParamSpec, param_specs

VALUE_HEAD = ("score.weight", "score.bias")  # critic head names, as HF *ForTokenClassification


class HFCheckpointReader:
    """Lazy access to the tensors of an HF checkpoint folder (safetensors, or a torch .bin)."""

    def __init__(self, path: str):
        self.path, self._where, self._bin = path, {}, None
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self._where = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            from safetensors import safe_open

            file = os.path.join(path, "model.safetensors")
            with safe_open(file, framework="pt") as f:
                self._where = {k: file for k in f.keys()}
        elif os.path.exists(os.path.join(path, "pytorch_model.bin")):
            self._bin = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu", weights_only=True)
        else:
            raise FileNotFoundError(f"no model.safetensors, model.safetensors.index.json or pytorch_model.bin "
                                    f"in {path}: pass model_path pointing at an HF checkpoint folder")

    def names(self) -> set[str]:
        return set(self._bin) if self._bin is not None else set(self._where)

    def get(self, name: str) -> Tensor:
        if self._bin is not None:
            return self._bin[name]
        if name not in self._where:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint at {self.path}")
        from safetensors import safe_open

        with safe_open(self._where[name], framework="pt") as f:
            return f.get_tensor(name)


def hf_to_shard(spec: ParamSpec, get: Callable[[str], Tensor], tp: int, tp_rank: int) -> Tensor:
    """This TP rank's Megatron tensor for ``spec`` from full HF tensors (fused: each part sliced
    separately, then concatenated, so rank r holds ``[q_r; k_r; v_r]`` / ``[gate_r; up_r]``)."""
    if spec.fused:
        return torch.cat([get(n).chunk(tp, dim=0)[tp_rank] for n in spec.hf_names], dim=0)
    full = get(spec.hf_names[0])
    return full if spec.split_dim is None else full.chunk(tp, dim=spec.split_dim)[tp_rank]


def fused_part_rows(spec: ParamSpec, dims: ModelDims, tp: int) -> list[int]:
    """Rows per TP rank of each part of a fused tensor, in ``spec.hf_names`` order."""
    if spec.fused == "qkv":
        return [dims.num_heads // tp * dims.head_dim] + [dims.num_kv_heads // tp * dims.head_dim] * 2
    if spec.fused == "gate_up":
        return [dims.intermediate_size // tp] * 2
    raise ValueError(f"{spec.name} is not fused")


def shards_to_hf(spec: ParamSpec, shards: list[Tensor], dims: ModelDims) -> list[tuple[str, Tensor]]:
    """Full HF tensors from the TP shards of ``spec`` (ordered by TP rank)."""
    tp = len(shards)
    if spec.fused:
        parts = [s.split(fused_part_rows(spec, dims, tp), dim=0) for s in shards]
        return [(name, torch.cat([p[i] for p in parts], dim=0)) for i, name in enumerate(spec.hf_names)]
    if spec.split_dim is None:
        return [(spec.hf_names[0], shards[0])]
    return [(spec.hf_names[0], torch.cat(shards, dim=spec.split_dim))]


def hf_shapes(spec: ParamSpec, dims: ModelDims, tp: int) -> list[tuple[int, ...]]:
    """Full HF shapes of the tensors ``spec`` maps to (non-owning stages allocate with these)."""
    if spec.fused:
        return [(rows * tp, *spec.shape_per_rank[1:]) for rows in fused_part_rows(spec, dims, tp)]
    shape = list(spec.shape_per_rank)
    if spec.split_dim is not None:
        shape[spec.split_dim] *= tp
    return [tuple(shape)]


@torch.no_grad()
def load_stage(model: nn.Module, model_path: str, dims: ModelDims, tp: int, tp_rank: int, pp: int,
               pp_rank: int) -> None:
    """Fill ``model`` (a MegatronCausalLM stage) from the HF checkpoint at ``model_path``."""
    reader = HFCheckpointReader(model_path)
    params = dict(model.named_parameters())
    filled = set()
    for spec in param_specs(dims, tp, pp, pp_rank):
        if spec.name == "output_layer.weight" and getattr(model, "head", "lm") != "lm":
            continue  # the critic has a value head instead of the LM head
        params[spec.name].copy_(hf_to_shard(spec, reader.get, tp, tp_rank))
        filled.add(spec.name)
    if pp_rank == pp - 1 and getattr(model, "head", "lm") == "lm" and dims.tied_embeddings and pp > 1:
        # the last stage's copy of the tied embedding (layout.py), identical to stage 0's slice
        params["output_layer.weight"].copy_(reader.get("model.embed_tokens.weight").chunk(tp, dim=0)[tp_rank])
    if pp_rank == pp - 1 and getattr(model, "head", "lm") == "value" and set(VALUE_HEAD) <= reader.names():
        for name in VALUE_HEAD:  # a saved critic; otherwise the seeded fresh head stays
            params[name].copy_(reader.get(name).reshape(params[name].shape))
    missing = set(params) - filled - {"output_layer.weight", *VALUE_HEAD}
    if missing:  # parameters are allocated uninitialised: every one must come from the checkpoint
        raise RuntimeError(f"load_stage: no checkpoint tensor for {sorted(missing)}; layout.py and the model disagree")


@torch.no_grad()
def export_hf(model: nn.Module, dims: ModelDims, tp: int, pp: int, pp_rank: int,
              tp_group: dist.ProcessGroup | None, pp_group: dist.ProcessGroup | None,
              device: torch.device, stage_ranks: list[int] | None = None) -> Iterator[tuple[str, Tensor]]:
    """Yield every full HF tensor on every rank (a collective: all ranks iterate in step).

    ``pp_rank`` is this rank's pipeline stage; ``stage_ranks[s]`` the global rank holding stage
    ``s`` (default: the pipeline group's rank ``s``; a reversed pipeline holds them backwards)."""
    if stage_ranks is None and pp > 1:
        stage_ranks = [dist.get_global_rank(pp_group, stage) for stage in range(pp)]
    params = dict(model.named_parameters())
    dtype = next(iter(params.values())).dtype
    last = pp - 1
    for stage in range(pp):
        for spec in param_specs(dims, tp, pp, stage):
            if spec.name == "output_layer.weight" and getattr(model, "head", "lm") != "lm":
                continue
            full: list[tuple[str, Tensor]] = []
            if stage == pp_rank:
                local = params[spec.name].detach()
                if tp > 1 and spec.split_dim is not None:
                    shards = [torch.empty_like(local) for _ in range(tp)]
                    dist.all_gather(shards, local.contiguous(), group=tp_group)
                else:
                    shards = [local]
                full = shards_to_hf(spec, shards, dims)
            else:
                full = [(n, torch.empty(s, dtype=dtype, device=device))
                        for n, s in zip(spec.hf_names, hf_shapes(spec, dims, tp))]
            for name, tensor in full:
                if pp > 1:
                    tensor = tensor.contiguous()
                    dist.broadcast(tensor, src=stage_ranks[stage], group=pp_group)
                yield name, tensor
        if stage != last or getattr(model, "head", "lm") != "value":
            continue
        for name in VALUE_HEAD:  # replicated over TP: no gather
            tensor = params[name].detach().clone() if stage == pp_rank else torch.empty(
                (1, dims.hidden_size) if name.endswith("weight") else (1,), dtype=dtype, device=device)
            if pp > 1:
                dist.broadcast(tensor, src=stage_ranks[stage], group=pp_group)
            yield name, tensor
