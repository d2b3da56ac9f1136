"""Hydra/OmegaConf config -> typed dataclasses. Unlike OmegaConf structured configs, an unknown key
names its dotted path and the closest valid key in the whole tree (one put in the wrong section is
found too), and every problem is reported in one line. Conversions are strict where a silent cast
would hide a mistake (a quoted number is not an int, ``1`` is not a bool); a list also takes a single
value (``trainer.logger=console``), as verl does.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridflow.config.derived import canonical_strategy
from hybridflow.config.errors import ConfigError
from hybridflow.config.keys import absolute_path, dotted_keys
from hybridflow.config.resolve import resolve
from hybridflow.config.root import RootConfig
from hybridflow.verl_compat import fold_ray_kwargs, inert_keys, pop_inert_keys, resume_path_mode

T = TypeVar("T")
_TYPE_WORDS = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}


def unknown_key_message(key: str, valid_keys: Sequence[str], cutoff: float = 0.6) -> str:
    """Names the valid key most like ``key``, compared on what follows the sections they share: whole
    dotted keys would match on a shared prefix alone (``data.tokenizer`` looked like ``data.seed``)."""
    parts, best, best_ratio = key.split("."), None, cutoff
    for candidate in valid_keys:
        if key.startswith(candidate + "."):  # the section the key is in
            continue
        other = candidate.split(".")
        shared = len(os.path.commonprefix([parts[:-1], other[:-1]]))  # the sections both are in
        ratio = difflib.SequenceMatcher(None, ".".join(parts[shared:]), ".".join(other[shared:])).ratio()
        if ratio > best_ratio:
            best, best_ratio = candidate, ratio
    return f"unknown config key '{key}'" + (f" (did you mean '{best}'?)" if best else "")


def load_config(cfg: Any, *, base_dir: str | None = None) -> RootConfig:
    """A composed Hydra config (DictConfig or plain dict) as :class:`RootConfig`, interpolations and
    ``auto`` values resolved, paths made absolute against ``base_dir`` (default: the working directory,
    so workers with another one find them). :class:`ConfigError` lists every unknown key and wrong type."""
    root = to_dataclass(RootConfig, cfg, base_dir=base_dir)
    fold_ray_kwargs(root)
    for role in (root.actor_rollout_ref.actor, root.actor_rollout_ref.ref, root.critic):
        role.strategy = canonical_strategy(role.strategy)
    resolve(root)
    root.trainer.resume_mode = resolve_resume_mode(root.trainer.resume_mode, root.trainer.resume_from_path, base_dir)
    return root


RESUME_MODES = ("auto", "disable")  # else trainer.resume_mode names a checkpoint folder


def resolve_resume_mode(mode: str, resume_from_path: str | None, base_dir: str | None) -> str:
    """auto | disable | an absolute folder (verl's ``resume_path`` takes ``resume_from_path``)."""
    mode = resume_path_mode(mode, resume_from_path)
    return mode if mode in RESUME_MODES else absolute_path(mode, base_dir)


def to_dataclass(cls: type[T], cfg: Any, *, base_dir: str | None = None) -> T:
    """The generic converter behind :func:`load_config` (also used for the SFT tree)."""
    data = _plain(cfg)
    if not isinstance(data, Mapping):
        raise ConfigError(f"the config must be a mapping of sections, got {type(data).__name__}")
    # Hydra itself may leave its "hydra" node in a composed config
    data, builder = {k: v for k, v in data.items() if k != "hydra"}, _Builder(dotted_keys(cls))
    inert_errors = pop_inert_keys(data, builder.valid_keys, inert_keys(cls))
    result = builder.build(cls, data, "")
    if builder.errors or inert_errors:
        raise ConfigError("; ".join(builder.errors + inert_errors))
    _absolutize_paths(result, base_dir)
    return result


def _absolutize_paths(node: Any, base_dir: str | None) -> None:
    """Make every ``path``-marked field absolute, defaults included (in place)."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            _absolutize_paths(value, base_dir)
        elif f.metadata.get("path") and isinstance(value, (str, list)):
            setattr(node, f.name, absolute_path(value, base_dir) if isinstance(value, str)
                    else [absolute_path(v, base_dir) for v in value])


def _plain(cfg: Any) -> Any:
    if not isinstance(cfg, (DictConfig, ListConfig)):
        return cfg
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        first, key = str(exc).strip().splitlines()[0], getattr(exc, "full_key", None)
        raise ConfigError(f"cannot resolve config key '{key}': {first}" if key else first) from exc


def _describe(tp: Any) -> str:
    if tp in _TYPE_WORDS:
        return _TYPE_WORDS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _parses_as(tp: Any, text: str) -> bool:
    """A number or boolean written in quotes."""
    if tp is bool:
        return text.lower() in ("true", "false")
    try:
        return tp in (int, float) and tp(text) is not None
    except ValueError:
        return False


class _Builder:
    def __init__(self, valid_keys: list[str]):
        self.valid_keys = valid_keys
        self.errors: list[str] = []

    def build(self, cls: type, data: Any, prefix: str) -> Any:
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, Mapping):
            self.errors.append(f"config key '{prefix.rstrip('.')}' must be a section (a mapping of keys: "
                               f"{', '.join(names)}), got {type(data).__name__} {data!r}: set one of its keys, "
                               f"e.g. {prefix}{names[0]}=...")
            return cls()
        hints, kwargs = typing.get_type_hints(cls), {}
        for k, value in data.items():  # in the config's order, so the messages are too
            if k in names:
                kwargs[k] = self.convert(hints[k], value, prefix + k)
            else:
                self.errors.append(unknown_key_message(prefix + k, self.valid_keys))
        return cls(**kwargs)

    def convert(self, tp: Any, value: Any, key: str) -> Any:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp is Any:
            return value
        if origin in (typing.Union, types.UnionType):
            if value is None and type(None) in args:
                return None
            options = [a for a in args if a is not type(None)]
            if len(options) == 1:
                return self.convert(options[0], value, key)
            for option in options:  # the first that takes the value, in the order written (int | str)
                trial = _Builder(self.valid_keys)
                converted = trial.convert(option, value, key)
                if not trial.errors:
                    return converted
            return self.fail(tp, value, key)
        if dataclasses.is_dataclass(tp):
            return self.build(tp, value, key + ".")
        if origin is list:
            if value is None:  # `data.val_files=null`: none
                return []
            if not isinstance(value, (list, tuple)):
                value = [value]  # a single value where a list is expected
            return [self.convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
        if origin is dict:
            return dict(value) if isinstance(value, Mapping) else self.fail(tp, value, key)
        if tp in _TYPE_WORDS:
            number = isinstance(value, (int, float)) and not isinstance(value, bool)  # True is an int to Python
            # str: Hydra parses `experiment_name=123` as an int; a name may well be a number
            ok = {bool: isinstance(value, bool), int: number and isinstance(value, int), float: number,
                  str: isinstance(value, str) or number}[tp]
            return tp(value) if ok else self.fail(tp, value, key)
        raise TypeError(f"config field '{key}' has an unsupported type {tp!r}")  # a schema bug

    def fail(self, tp: Any, value: Any, key: str) -> Any:
        hint = " (remove the quotes)" if isinstance(value, str) and _parses_as(tp, value) else ""
        self.errors.append(f"config key '{key}' must be {_describe(tp)}, got "
                           f"{type(value).__name__} {value!r}{hint}")
        return value
