"""One declaration per config key: ``key(default, doc, check=..., choices=...)`` keeps a field's
default, its one-line doc, its allowed range or names and whether it is a path on the dataclass
field. Loading, the range and name checks and ``--help`` read them from there; the recipes' base
config is built from it.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import os
import typing
from collections.abc import Iterator
from typing import Any, Callable, Collection, NamedTuple

from hybridflow.verl_compat import ARR  # noqa: F401  (re-exported: config modules name the section by it)


class Range(NamedTuple):
    ok: Callable[[Any], bool]
    what: str  # what the value must be, as the error message says it


POSITIVE = Range(lambda v: v >= 1, "a positive integer")
OPTIONAL_POSITIVE = Range(lambda v: v is None or v >= 1, "null or a positive integer")
NON_NEGATIVE = Range(lambda v: v >= 0, ">= 0")
GREATER_THAN_0 = Range(lambda v: v > 0, "> 0")
OPTIONAL_GT_0 = Range(lambda v: v is None or v > 0, "null or > 0")
UNIT = Range(lambda v: 0 <= v <= 1, "in [0, 1]")
OPEN_UNIT = Range(lambda v: 0 < v <= 1, "in (0, 1]")
# verl reads any frequency <= 0 as off; -1 is the documented spelling, 0 is accepted as well
FREQ = Range(lambda v: v >= -1, "-1 or 0 (off) or a positive number of steps")
MAX_SAMPLES = Range(lambda v: v == -1 or v >= 1, "-1 (all) or a positive number of prompts")
TOP_K = Range(lambda v: v == -1 or v >= 1, "-1 (off) or a positive integer")
NOT_EMPTY = Range(bool, "not empty")


class Registry(NamedTuple):
    """Allowed names kept by a registry outside config (``module.NAME``), imported only when a value
    is checked, so ``import hybridflow.config`` stays torch-free."""
    name: str
    module: str = "hybridflow.algorithms"
    extensible: bool = False  # a module named by actor_rollout_ref.model.external_lib may register more

    def names(self) -> Collection:
        return getattr(importlib.import_module(self.module), self.name)


def key(default: Any, doc: str, check: Range | None = None, path: bool = False, composed: Any = None,
        choices: Collection | Registry | None = None) -> Any:
    """A config field. ``path``: a filesystem path that ``load_config`` makes absolute (Ray workers
    need not share the driver's working directory). ``composed``: what the recipes' base config
    holds instead of ``default`` (an interpolation that evaluates to it). ``choices``: the names a
    value (each item of a list value) may take; null is not checked."""
    metadata = {"doc": doc, "check": check, "path": path, "composed": composed, "choices": choices}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def dataclass_in(tp: Any) -> type | None:
    """The config dataclass a field's type names (``X`` or ``X | None``), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    return next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), None)


def walk(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, type) of every key of a config dataclass tree, sections included,
    each section before its keys."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield prefix + f.name, f, hints[f.name]
        sub = dataclass_in(hints[f.name])
        if sub is not None:
            yield from walk(sub, f"{prefix}{f.name}.")


def dotted_keys(cls: type) -> list[str]:
    """Every valid dotted key of a config dataclass tree, sections included."""
    return [dotted for dotted, _, _ in walk(cls)]


def absolute_path(path: str, base_dir: str | None) -> str:
    return os.path.abspath(os.path.join(base_dir or os.getcwd(), os.path.expanduser(path)))
