"""Write an ordinary HF checkpoint (safetensors + config + tokenizer) from (name, tensor) pairs.

Shared by the engines' ``save_hf``: the engine streams full tensors under HF names, rank 0 passes
them here. Tokenizer files are copied byte for byte from the source checkpoint instead of
re-saved through a tokenizer object, because transformers 5 re-saving can lose the markers that
make a custom tokenizer load as itself (docs/environment.md, tokenizer trap).
"""
from __future__ import annotations

import copy
import os
import shutil
from typing import Iterable, Iterator

import torch
from safetensors.torch import save_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json", ".bin.index.json")


def in_checkpoint_layout(model, named_tensors: Iterable[tuple[str, torch.Tensor]]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors as its checkpoint stores them, one tensor at a time.

    transformers 5 loads some checkpoints into a layout of its own (MoE models: each layer's
    experts fused into one 3-D ``mlp.experts.gate_up_proj``), and ``state_dict()`` names that
    layout. vLLM's loaders, and HF checkpoints written for others to read, want the checkpoint's
    (``block_sparse_moe.experts.N.w1.weight``). transformers' own ``revert_weight_conversion``
    maps each runtime tensor back; models it loads unchanged pass straight through.
    """
    from transformers.core_model_loading import revert_weight_conversion

    if not _has_weight_conversions(model):
        yield from named_tensors
        return
    for name, tensor in named_tensors:
        yield from revert_weight_conversion(model, {name: tensor}).items()


def _has_weight_conversions(model) -> bool:
    conversions = getattr(model, "_weight_conversions", None)  # set by from_pretrained
    if conversions is None:
        from transformers.conversion_mapping import get_model_conversion_mapping

        conversions = get_model_conversion_mapping(model, add_legacy=False)
    return bool(conversions)


def copy_tokenizer_files(source_dir: str, target_dir: str) -> list[str]:
    """Copy every top-level file of ``source_dir`` that is not a weight file or config.json."""
    copied = []
    for name in sorted(os.listdir(source_dir)):
        src = os.path.join(source_dir, name)
        if not os.path.isfile(src) or name == "config.json" or name.endswith(WEIGHT_SUFFIXES):
            continue
        shutil.copy2(src, os.path.join(target_dir, name))
        copied.append(name)
    return copied


def write_hf_checkpoint(path: str, tensors: Iterable[tuple[str, torch.Tensor]], hf_config,
                        architecture: str, source_dir: str | None = None) -> None:
    """Save ``tensors`` as ``model.safetensors`` plus ``config.json`` naming ``architecture``.

    ``architecture`` is the model class name (e.g. ``Qwen2ForCausalLM``); it is passed explicitly
    because a wrapped training model's class name (FSDP renames it) is not one transformers knows.
    """
    os.makedirs(path, exist_ok=True)
    state = {name: t.detach().to("cpu").contiguous() for name, t in tensors}
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(hf_config)
    config.architectures = [architecture]
    if getattr(config, "use_cache", None) is False:  # the engines train without it; generate() wants it
        config.use_cache = True
    config.save_pretrained(path)
    if source_dir is not None:
        copy_tokenizer_files(source_dir, path)
