"""Which linear layers LoRA adapts: peft's / verl's ``target_modules`` and ``exclude_modules``
rules, matched against an HF model's modules.

In the core, not in ``workers/engines/lora.py`` which applies them, because the config check
(``hybridflow/model_checks.py``) matches a run's list on a meta-device model before Ray
starts, and the core never imports ``workers`` (DESIGN.md).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

ALL_LINEAR = "all-linear"  # peft's / verl's name for every linear layer of the decoder layers


def _name_matches(name: str, patterns: Sequence[str]) -> bool:
    """peft's rule for a list: the module's own name, or a dotted suffix of its path."""
    return any(name == p or name.endswith("." + p) for p in patterns)


def target_linear_names(model: nn.Module, target_modules: str | Sequence[str],
                        exclude_modules: Sequence[str] | None = None) -> list[str]:
    """Paths of the ``nn.Linear`` modules to adapt. ``all-linear``: every linear layer inside the
    decoder layers (not the LM head or a value head). A list names modules (``q_proj``) or path
    suffixes (``mlp.down_proj``); a name that matches no linear layer is an error."""
    # only inside the decoder layers: the LM head (often tied to the embedding) and a value head
    # are never adapted, whether named or not
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [name for name, m in model.named_modules() if type(m).__name__ in layer_classes]
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and any(name.startswith(layer + ".") for layer in layers)}
    excluded = list(exclude_modules or [])
    if target_modules == ALL_LINEAR or list(target_modules) == [ALL_LINEAR]:
        names = list(linears)
    else:
        patterns = [target_modules] if isinstance(target_modules, str) else list(target_modules)
        names = [n for n in linears if _name_matches(n, patterns)]
        unmatched = [p for p in patterns if not any(_name_matches(n, [p]) for n in linears)]
        if unmatched:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
            raise ValueError(f"lora target_modules {unmatched} match no linear layer in the decoder layers of "
                             f"{type(model).__name__}; use '{ALL_LINEAR}' or some of {leaves}")
    names = [n for n in names if not _name_matches(n, excluded)]
    if not names:
        raise ValueError(f"lora target_modules={target_modules!r} (exclude_modules={excluded}) leave no linear "
                         f"layer of {type(model).__name__} to adapt")
    return names
