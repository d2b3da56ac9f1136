"""Hydra/OmegaConf config -> typed dataclasses, rejecting unknown keys and wrong types.

Unlike OmegaConf structured configs, an unknown key names its full dotted path and the closest
valid key (difflib over every key of the tree, so a key put in the wrong section is found too),
and every problem found is reported in one line instead of stopping at the first.
Conversions are strict where a silent cast would hide a mistake: a quoted number is not an int,
``1`` is not a bool. Lists also accept a single value (``trainer.logger=console``), as verl does.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from hybridflow.config import auto_fsdp_size
from hybridflow.config.derived import canonical_strategy, needs_critic, resolve_param_dtype
from hybridflow.config.errors import ConfigError
from hybridflow.config.keys import dotted_keys, mapping_keys
from hybridflow.config.root import RootConfig
from hybridflow.config.verl_inert import inert_keys, is_inert, pop_inert_keys

T = TypeVar("T")
# Top-level nodes Hydra itself may leave in a composed config.
IGNORED_TOP_LEVEL = ("hydra",)
RECIPES_CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "recipes" / "config")
# verl's config names -> what to pass here instead
VERL_CONFIG_NAMES = {"ppo_trainer": "'ppo'",
                     "ppo_megatron_trainer": "'ppo' with actor_rollout_ref.actor.strategy=megatron",
                     "sft_trainer": "'sft'"}
RESUME_MODES = ("auto", "disable")
_TYPE_WORDS = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}


def unknown_key_message(key: str, valid_keys: Sequence[str]) -> str:
    close = _closest_key(key, valid_keys)
    hint = f" (did you mean '{close}'?)" if close else ""
    return f"unknown config key '{key}'{hint}"


def _closest_key(key: str, valid_keys: Sequence[str], cutoff: float = 0.6) -> str | None:
    """The valid key most like ``key``, compared on what follows the sections they share: whole
    dotted keys would match on a shared prefix alone (``data.tokenizer`` looked like ``data.seed``)."""
    parts = key.split(".")
    best, best_ratio = None, cutoff
    for candidate in valid_keys:
        if key.startswith(candidate + "."):  # the section the key is in
            continue
        other = candidate.split(".")
        shared = 0
        while shared < min(len(parts), len(other)) - 1 and parts[shared] == other[shared]:
            shared += 1
        ratio = difflib.SequenceMatcher(None, ".".join(parts[shared:]), ".".join(other[shared:])).ratio()
        if ratio > best_ratio:
            best, best_ratio = candidate, ratio
    return best


def load_config(cfg: Any, *, base_dir: str | None = None) -> RootConfig:
    """Convert a composed Hydra config (DictConfig or plain dict) to :class:`RootConfig`.

    Interpolations are resolved; path fields are made absolute against ``base_dir`` (default:
    the current directory) so workers with another working directory find them. Raises
    :class:`ConfigError` listing every unknown key and wrong type.
    """
    root = to_dataclass(RootConfig, cfg, base_dir=base_dir)
    _fold_ray_kwargs(root)
    for role in (root.actor_rollout_ref.actor, root.actor_rollout_ref.ref, root.critic):
        role.strategy = canonical_strategy(role.strategy)
    # the reference computes as the actor; an unused critic's auto stays unresolved (and unsaid)
    for role in (root.actor_rollout_ref.actor, *([root.critic] if needs_critic(root) else [])):
        role.param_dtype = resolve_param_dtype(role.param_dtype, root.trainer.device)
    auto_fsdp_size.resolve_rl(root)
    root.trainer.resume_mode = resolve_resume_mode(root.trainer.resume_mode, root.trainer.resume_from_path, base_dir)
    return root


def resolve_resume_mode(mode: str, resume_from_path: str | None, base_dir: str | None) -> str:
    """auto | disable | an absolute folder; verl's ``resume_path`` takes ``resume_from_path``."""
    if mode == "resume_path":  # verl's spelling of "resume from this folder"
        if not resume_from_path:
            raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<a global_step_N "
                              "folder> (or set trainer.resume_mode=<that folder> directly)")
        mode = resume_from_path
    return mode if mode in RESUME_MODES else absolute_path(mode, base_dir)


def _fold_ray_kwargs(root: RootConfig) -> None:
    """verl moved ``ray_init`` under ``ray_kwargs``; accept both, one value per key."""
    new, old = root.ray_kwargs.ray_init, root.ray_init
    for f in dataclasses.fields(new):
        value, current = getattr(new, f.name), getattr(old, f.name)
        if value is None or value == current:
            continue
        if current is not None:
            raise ConfigError(f"ray_kwargs.ray_init.{f.name}={value!r} and ray_init.{f.name}={current!r} set the "
                              "same thing (verl's newer and older key): keep one of them")
        setattr(old, f.name, value)


def to_dataclass(cls: type[T], cfg: Any, *, base_dir: str | None = None) -> T:
    """The generic converter behind :func:`load_config` (also used for the SFT tree)."""
    data = _plain(cfg)
    if not isinstance(data, Mapping):
        raise ConfigError(f"the config must be a mapping of sections, got {type(data).__name__}")
    data = {k: v for k, v in data.items() if k not in IGNORED_TOP_LEVEL}
    valid = dotted_keys(cls)
    inert_errors = pop_inert_keys(data, valid, inert_keys(cls))
    builder = _Builder(valid)
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
        elif f.metadata.get("path") and isinstance(value, str):
            setattr(node, f.name, absolute_path(value, base_dir))
        elif f.metadata.get("path") and isinstance(value, list):
            setattr(node, f.name, [absolute_path(v, base_dir) for v in value])


def compose_config(config_name: str, overrides: Iterable[str] = (), *, config_dir: str | None = None,
                   schema: type = RootConfig):
    """Hydra's compose API with verl-style errors: an override of a key that does not exist
    raises :class:`ConfigError` naming it and the closest valid key (Hydra's own message only
    suggests ``+key=``), or, for a new key under a free-form mapping (:func:`mapping_keys`), the
    ``+key=value`` override that adds it. Returns the composed DictConfig; pass it to
    :func:`load_config`."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    folder = config_dir or RECIPES_CONFIG_DIR
    if not Path(folder, config_name.removesuffix(".yaml") + ".yaml").is_file():
        names = sorted(p.stem for p in Path(folder).glob("*.yaml"))
        hint = VERL_CONFIG_NAMES.get(config_name.removesuffix(".yaml"))
        raise ConfigError(f"--config-name {config_name}: no such config in {folder}: use one of "
                          f"{', '.join(names)}" + (f" (verl's {config_name} is {hint} here)" if hint else ""))
    # verl's inert keys are not in the recipes' YAML: let Hydra add them ("++" adds or replaces)
    inert = inert_keys(schema)
    overrides = [f"++{o.lstrip('+')}" if is_inert(_override_key(o) or "", inert) else o for o in overrides]
    try:
        with initialize_config_dir(config_dir=folder, version_base=None):
            return compose(config_name=config_name, overrides=overrides)
    except HydraException as exc:
        valid, mappings = dotted_keys(schema), mapping_keys(schema)
        messages = []
        for override in overrides:
            key = _override_key(override)
            if key is None or key in valid or is_inert(key, inert):
                continue
            mapping = next((m for m in mappings if key.startswith(m + ".")), None)
            if mapping is None:
                messages.append(unknown_key_message(key, valid))
            elif not override.startswith("+"):  # with '+' Hydra adds it: another override failed
                messages.append(f"config key '{key}' is new: '{mapping}' is a free-form mapping, so add "
                                f"a key to it with Hydra's '+' prefix: +{override}")
        if messages:
            raise ConfigError("; ".join(messages)) from exc
        raise ConfigError(str(exc).strip().replace("\n", " ")) from exc


def split_cli_args(argv: Sequence[str], default_config_name: str) -> tuple[str, list[str]]:
    """``['--config-name', 'grpo', 'k=v']`` -> ``('grpo', ['k=v'])`` (also ``-cn X``,
    ``--config-name=X``), for entry points that call :func:`compose_config` themselves."""
    name, overrides, args = default_config_name, [], list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("--config-name", "-cn"):
            if not args:
                raise ConfigError(f"{arg} needs a config name, e.g. {arg} grpo")
            name = args.pop(0)
        elif arg.startswith("--config-name="):
            name = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    return name, overrides


def _override_key(override: str) -> str | None:
    if override.startswith("~") or "=" not in override:
        return None  # deletions and flags are Hydra's business
    key = override.split("=", 1)[0].lstrip("+")
    return None if key.startswith("hydra.") or "@" in key else key


def _plain(cfg: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
        from omegaconf.errors import OmegaConfBaseException
    except ImportError:  # pragma: no cover - omegaconf ships with hydra, a dependency
        return cfg
    if isinstance(cfg, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(cfg, resolve=True)
        except OmegaConfBaseException as exc:
            first = str(exc).strip().splitlines()[0]
            key = getattr(exc, "full_key", None)
            raise ConfigError(f"cannot resolve config key '{key}': {first}" if key else first) from exc
    return cfg


def absolute_path(path: str, base_dir: str | None) -> str:
    return os.path.abspath(os.path.join(base_dir or os.getcwd(), os.path.expanduser(path)))


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
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return False
    if tp is bool:
        return text.lower() in ("true", "false")
    try:
        tp(text)
        return tp in (int, float)
    except ValueError:
        return False


class _Builder:
    def __init__(self, valid_keys: list[str]):
        self.valid_keys = valid_keys
        self.errors: list[str] = []

    def build(self, cls: type, data: Any, prefix: str) -> Any:
        if not isinstance(data, Mapping):
            keys = ", ".join(f.name for f in dataclasses.fields(cls))
            self.errors.append(f"config key '{prefix.rstrip('.')}' must be a section (a mapping of "
                               f"keys: {keys}), got {type(data).__name__} {data!r}: set one of its keys, "
                               f"e.g. {prefix}{dataclasses.fields(cls)[0].name}=...")
            return cls()
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in data.items():
            dotted = f"{prefix}{key}"
            if key not in fields:
                self.errors.append(unknown_key_message(dotted, self.valid_keys))
                continue
            kwargs[key] = self.convert(hints[key], value, dotted)
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
        if tp is bool:
            return value if isinstance(value, bool) else self.fail(tp, value, key)
        if tp is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
            return value if ok else self.fail(tp, value, key)
        if tp is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            return float(value) if ok else self.fail(tp, value, key)
        if tp is str:
            # Hydra parses `experiment_name=123` as an int; a name may well be a number.
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
            return value if isinstance(value, str) else self.fail(tp, value, key)
        raise TypeError(f"config field '{key}' has an unsupported type {tp!r}")  # a schema bug

    def fail(self, tp: Any, value: Any, key: str) -> Any:
        hint = " (remove the quotes)" if isinstance(value, str) and _parses_as(tp, value) else ""
        self.errors.append(f"config key '{key}' must be {_describe(tp)}, got "
                           f"{type(value).__name__} {value!r}{hint}")
        return value


def cli_info(argv: Sequence[str], default_config_name: str, usage: str,
             schema: type = RootConfig) -> str | None:
    """What ``--help`` / ``-h`` and Hydra's ``--cfg job`` ask an entry point to print instead of
    running, or None to run. ``--cfg job`` (also ``all``) prints the composed config as YAML
    after the overrides, so a user sees every key and value the run would get; keys the run
    would reject (unknown, wrongly typed) are rejected here too."""
    args = list(argv)
    if "--help" in args or "-h" in args:
        configs = sorted(p.stem for p in Path(RECIPES_CONFIG_DIR).glob("*.yaml"))
        return (f"{usage.strip()}\n\nconfigs (--config-name): {', '.join(configs)} (default "
                f"{default_config_name})\nprint a config with its overrides applied: --cfg job key=value ...")
    if "--cfg" not in args:
        return None
    at = args.index("--cfg")
    what = args[at + 1] if at + 1 < len(args) else None
    if what not in ("job", "all"):
        raise ConfigError(f"--cfg takes 'job' (the run's config), e.g. --cfg job; got {what!r}")
    from omegaconf import OmegaConf

    name, overrides = split_cli_args(args[:at] + args[at + 2:], default_config_name)
    composed = compose_config(name, overrides, schema=schema)
    to_dataclass(schema, composed)  # an added (+) key or a wrong type fails here as it would in a run
    return OmegaConf.to_yaml(composed).rstrip()
