"""Single-key value ranges and allowed names, read from the fields' declarations
(``keys.key(check=..., choices=...)``), plus the few ranges that depend on another key."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from operator import attrgetter
from typing import Any, Callable

from hybridflow.config.keys import ARR, GREATER_THAN_0, POSITIVE, Registry, dataclass_in, walk
from hybridflow.config.root import RootConfig
from hybridflow.config.rules import unknown_name

Check = tuple[str, Any, Callable[[Any], bool], str]  # key, value, ok(value), what it must be


def leaves(node: Any) -> Iterator[tuple[str, Any, dict]]:
    """(dotted key, value, field metadata) of every non-section field of a config tree, in order."""
    for dotted, f, tp in walk(type(node)):
        if dataclass_in(tp) is None:
            yield dotted, attrgetter(dotted)(node), f.metadata


def name_errors(node: Any) -> list[str]:
    """Every value (each item of a list) outside its field's declared ``choices``; null is not checked."""
    errors = []
    for k, value, meta in leaves(node):
        choices = meta.get("choices")
        if choices is None or value is None:
            continue
        allowed = choices.names() if isinstance(choices, Registry) else choices
        # docs/extending.md: a user's module may register its own estimator or loss
        extra = (f" (or register your own in a module named by {ARR}.model.external_lib)"
                 if isinstance(choices, Registry) and choices.extensible else "")
        errors += [unknown_name(k, v, allowed) + extra for v in (value if isinstance(value, list) else [value])
                   if v not in allowed]
    return errors


def non_finite_errors(node: Any, key: str = "") -> list[str]:
    """Every float in the config tree (dataclass fields, lists, dicts such as override_config) must
    be finite: ``lr=inf`` passes ``> 0`` and trains on NaN, and NaN fails every comparison only where
    a range happens to check the key. One walk covers keys without a range."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        items = [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
    elif isinstance(node, dict):
        items = [(str(k), v) for k, v in node.items()]
    elif isinstance(node, (list, tuple)):  # critic.optim.betas -> critic.optim.betas[1]
        return [e for i, v in enumerate(node) for e in non_finite_errors(v, f"{key}[{i}]")]
    elif isinstance(node, float) and not math.isfinite(node):
        return [f"{key}={node!r} must be a finite number, not inf or nan"]
    else:
        return []
    prefix = f"{key}." if key else ""
    return [e for name, value in items for e in non_finite_errors(value, prefix + name)]


def range_errors(cfg: RootConfig) -> list[str]:
    rows: list[Check] = []
    rm, kl_ctrl = cfg.reward_model, cfg.algorithm.kl_ctrl
    if rm.enable_resource_pool:  # the reward model's own pool: nnodes x n_gpus_per_node slots
        rows += [("reward_model.n_gpus_per_node", rm.n_gpus_per_node, *POSITIVE),
                 ("reward_model.nnodes", rm.nnodes, *POSITIVE)]
    if kl_ctrl.type == "adaptive":  # Ziegler et al. (2019) eq. 2 divides by both
        rows += [("algorithm.kl_ctrl.target_kl", kl_ctrl.target_kl, *GREATER_THAN_0),
                 ("algorithm.kl_ctrl.horizon", kl_ctrl.horizon, *POSITIVE)]
    return tree_range_errors(cfg, rows)


def tree_range_errors(cfg: Any, extra: list[Check] = ()) -> list[str]:
    """Non-finite values, then every declared range (and ``extra`` rows) a value falls outside. A key
    named by the first is not repeated (nan also fails its range, but 'must be finite' is the message
    that says what is wrong)."""
    non_finite = non_finite_errors(cfg)
    named = {e.split("=", 1)[0].split("[", 1)[0] for e in non_finite}  # betas[1] names betas
    rows = [(k, value, *meta["check"]) for k, value, meta in leaves(cfg) if meta.get("check")] + list(extra)
    return non_finite + [f"{key}={value!r} must be {what}" for key, value, ok, what in rows
                         if key not in named and not ok(value)]
