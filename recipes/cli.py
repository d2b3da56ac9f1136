"""The entry points' command line: Hydra's compose with our errors, ``--cfg job`` and ``--help``.

The recipes' YAML files (``recipes/config/*.yaml``) start from ``defaults: [base, _self_]`` and
change only what makes them differ. ``base`` (every key of an RL run with its default) and
``sft`` are not files: they are built from the config dataclasses (:func:`composed_tree`) and
put in Hydra's ConfigStore, so each key is declared once, on its field.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf

from hybridflow.config.errors import ConfigError
from hybridflow.config.keys import dataclass_in, dotted_keys, walk
from hybridflow.config.load import to_dataclass, unknown_key_message
from hybridflow.config.root import RootConfig
from hybridflow.config.sft import SFTConfig
from hybridflow.verl_compat import inert_keys, is_inert

RECIPES_CONFIG_DIR = str(Path(__file__).resolve().parent / "config")
# the configs built from the dataclasses (name -> schema)
STORED_CONFIGS = {"base": RootConfig, "sft": SFTConfig}
# Hydra's own settings for both: keep relative paths relative to where the command runs
HYDRA_NODE = {"job": {"chdir": False}, "run": {"dir": "${trainer.default_local_dir}/hydra"}, "output_subdir": None}
# verl's config names -> what to pass here instead
VERL_CONFIG_NAMES = {"ppo_trainer": "'ppo'",
                     "ppo_megatron_trainer": "'ppo' with actor_rollout_ref.actor.strategy=megatron",
                     "sft_trainer": "'sft'"}


def config_names(folder: str = RECIPES_CONFIG_DIR) -> list[str]:
    return sorted({*(p.stem for p in Path(folder).glob("*.yaml")), *STORED_CONFIGS})


def composed_tree(node: Any) -> dict:
    """The recipes' base config: every key of a config instance with its value (a field's
    ``composed`` value where it has one), as plain data for Hydra."""
    tree = {}
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            tree[f.name] = composed_tree(value)
        else:
            composed = f.metadata.get("composed")
            tree[f.name] = copy.deepcopy(value) if composed is None else composed
    return tree


def mapping_keys(cls: type) -> list[str]:
    """Dotted keys of the dict-typed fields (``reward_kwargs``, ``engine_kwargs.vllm``): their own
    keys are the user's, so no schema lists them."""
    return [dotted for dotted, _, tp in walk(cls)
            if any(typing.get_origin(t) is dict for t in (tp, *typing.get_args(tp)))]


def _store_configs() -> None:
    for name, schema in STORED_CONFIGS.items():
        ConfigStore.instance().store(name=name, node={**composed_tree(schema()), "hydra": HYDRA_NODE})


def compose_config(config_name: str, overrides: Iterable[str] = (), *, config_dir: str | None = None,
                   schema: type = RootConfig):
    """Hydra's compose API with verl-style errors: an override of a key that does not exist
    raises :class:`ConfigError` naming it and the closest valid key (Hydra's own message only
    suggests ``+key=``), or, for a new key under a free-form mapping (:func:`mapping_keys`),
    the ``+key=value`` override that adds it. Returns the composed DictConfig; pass it to
    :func:`load_config`."""
    folder = config_dir or RECIPES_CONFIG_DIR
    name = config_name.removesuffix(".yaml")
    if name not in config_names(folder):
        hint = VERL_CONFIG_NAMES.get(name)
        raise ConfigError(f"--config-name {config_name}: no such config in {folder}: use one of "
                          f"{', '.join(config_names(folder))}"
                          + (f" (verl's {config_name} is {hint} here)" if hint else ""))
    _store_configs()
    # verl's inert keys are not in the base config: let Hydra add them ("++" adds or replaces)
    inert = inert_keys(schema)
    overrides = [f"++{o.lstrip('+')}" if is_inert(_override_key(o) or "", inert) else o for o in overrides]
    try:
        with initialize_config_dir(config_dir=folder, version_base=None):
            return compose(config_name=name, overrides=overrides)
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


def _shown(value) -> str:
    """A default as a Hydra override would spell it."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_shown(v) for v in value) + "]"
    return str(value)


def key_help(schema: type) -> str:
    """Every key of a config tree, one line each (name=default, doc, range), under its section."""
    sections: dict[str, list[str]] = {}
    defaults = composed_tree(schema())
    for dotted, f, tp in walk(schema):
        section, _, name = dotted.rpartition(".")
        if dataclass_in(tp) is not None:
            sections.setdefault(dotted, [])
            continue
        default = functools.reduce(lambda node, part: node[part], dotted.split("."), defaults)
        check = f.metadata.get("check")
        sections.setdefault(section, []).append(f"  {name}={_shown(default)}  {f.metadata.get('doc', '')}"
                                                + (f"  [{check.what}]" if check else ""))
    return "\n".join(f"{section}:\n" + "\n".join(lines) for section, lines in sections.items() if lines)


def cli_info(argv: Sequence[str], default_config_name: str, usage: str,
             schema: type = RootConfig) -> str | None:
    """What ``--help`` / ``-h`` and Hydra's ``--cfg job`` ask an entry point to print instead of
    running, or None to run. ``--help`` lists every key with its default, doc and range. ``--cfg
    job`` (also ``all``) prints the composed config as YAML after the overrides, so a user sees
    every key and value the run would get; keys the run would reject are rejected here too."""
    args = list(argv)
    if "--help" in args or "-h" in args:
        return (f"{usage.strip()}\n\nconfigs (--config-name): {', '.join(config_names())} (default "
                f"{default_config_name})\nprint a config with its overrides applied: --cfg job key=value ...\n\n"
                f"keys (key=default  what it is  [allowed values]); set one with key=value:\n{key_help(schema)}")
    if "--cfg" not in args:
        return None
    at = args.index("--cfg")
    what = args[at + 1] if at + 1 < len(args) else None
    if what not in ("job", "all"):
        raise ConfigError(f"--cfg takes 'job' (the run's config), e.g. --cfg job; got {what!r}")
    name, overrides = split_cli_args(args[:at] + args[at + 2:], default_config_name)
    composed = compose_config(name, overrides, schema=schema)
    to_dataclass(schema, composed)  # an added (+) key or a wrong type fails here as it would in a run
    return OmegaConf.to_yaml(composed).rstrip()
