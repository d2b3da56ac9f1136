"""verl's ``model.override_config`` and ``model.external_lib``: the HF config every model of a run
is built from, and the module that must be imported before any of them.

One function, :func:`apply_overrides`, changes the checkpoint's ``PretrainedConfig`` for every
consumer (FSDP and Megatron engines, the reference policy, the critic, and vLLM through a callable
``hf_overrides``), so they all build the same model and an HF checkpoint saved from an engine
carries the config it trained with. The config check before any worker starts
(``hybridflow/config/validate.py``) calls :func:`override_errors` and :func:`external_lib_error`.
transformers is imported lazily: the config package stays light without overrides.

``attn_implementation`` is verl's one override that is not a config attribute: verl pops it out of
``override_config`` and passes it to ``from_pretrained``, which is the only place transformers 5
takes it (a plain attribute of that name is ignored). :func:`load_options` hands it to the HF
model loader (``workers/engines/hf_model.py``); :func:`apply_overrides` leaves it out, so vLLM,
which has attention kernels of its own, and the Megatron engine's model never see it.
"""
from __future__ import annotations

import copy
import difflib
import importlib
from typing import Any, Mapping

# Attributes the checkpoint's weights fix: a different value cannot load (or would misread) them
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "head_dim", "tie_word_embeddings", "model_type", "architectures")
# transformers 5 moved these into ``rope_parameters``: a config has no attribute of the name, and
# setting one would be ignored by the model (and by vLLM, which keeps the existing rope_theta)
ROPE_PARAMETER_KEYS = ("rope_theta",)
# rope types that scale from the length the model was trained at (transformers' list)
LENGTH_SCALING_ROPE_TYPES = ("llama3", "yarn", "longrope")
# override_config keys that choose how transformers builds the model, passed to from_pretrained
LOAD_KEYS = ("attn_implementation",)


def load_options(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``from_pretrained`` keyword arguments ``overrides`` holds (``attn_implementation``)."""
    return {k: v for k, v in (overrides or {}).items() if k in LOAD_KEYS}


def config_overrides(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The HF config attributes ``overrides`` replaces: all but :data:`LOAD_KEYS`."""
    return {k: v for k, v in (overrides or {}).items() if k not in LOAD_KEYS}


def attention_implementations() -> list[str]:
    """The ``attn_implementation`` values transformers can build here: eager and its registered kernels."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ["eager", *(k for k in ALL_ATTENTION_FUNCTIONS if "|" not in k)]


def _load_option_errors(key: str, options: Mapping[str, Any]) -> list[str]:
    value = options.get("attn_implementation")
    if value is None:  # null: transformers' default (sdpa where torch has it)
        return []
    known = attention_implementations()
    if value not in known:
        return [f"{key}.attn_implementation={value!r} is not an attention transformers knows: use one of {known} "
                "(eager or sdpa on a CPU)"]
    return []


def import_external_lib(name: str | None) -> None:
    """Import ``name`` (a module that registers a model with transformers, say) if it is set."""
    if name:
        importlib.import_module(name)


def external_lib_error(key: str, name: str | None) -> str | None:
    """One line naming ``key`` when its module cannot be imported here (the driver), else None."""
    try:
        import_external_lib(name)
    except Exception as err:  # a module that raises while importing is as unusable as a missing one
        reason = str(err).splitlines()[0] if str(err) else ""
        return (f"{key}={name!r} cannot be imported ({type(err).__name__}: {reason}): install it or put its "
                "folder on PYTHONPATH")
    return None


def _rope_dicts(config) -> list[dict]:
    params = config.rope_parameters
    nested = config.nested_rope_parameter_keys(params) if hasattr(config, "nested_rope_parameter_keys") else []
    return [params[k] for k in nested if params[k] is not None] or [params]


def _holds_rope_key(config, key: str) -> bool:
    return (key in ROPE_PARAMETER_KEYS and key not in vars(config)
            and isinstance(getattr(config, "rope_parameters", None), dict))


def _merged(current: Mapping, update: Mapping) -> dict:
    """A partial update of a mapping attribute (``+...override_config.rope_scaling.factor=4``)
    keeps the other entries; the legacy ``type`` would lose to a kept ``rope_type``, so it is
    renamed."""
    update = dict(update)
    if "type" in update and "rope_type" not in update:
        update["rope_type"] = update.pop("type")
    return {**current, **update}


def _set(config, key: str, value: Any) -> None:
    from transformers import PretrainedConfig

    if _holds_rope_key(config, key):
        for params in _rope_dicts(config):
            params[key] = value
        return
    current = getattr(config, key, None)
    if isinstance(value, Mapping) and isinstance(current, PretrainedConfig):  # a sub-config (text_config)
        for name, item in value.items():
            _set(current, name, item)
        return
    if isinstance(value, Mapping) and isinstance(current, Mapping):
        value = _merged(current, value)
    setattr(config, key, copy.deepcopy(value))


def apply_overrides(config, overrides: Mapping[str, Any] | None):
    """A copy of the HF ``config`` with ``overrides`` (attribute -> value) applied, as verl's
    ``update_model_config`` does, plus: rope keys land where transformers 5 reads them, and a
    mapping updates a mapping attribute (``rope_scaling``) key by key. The rope parameters are
    then standardised and validated by transformers (a bad rope_scaling fails here)."""
    config = copy.deepcopy(config)
    trained_length = getattr(config, "max_position_embeddings", None)
    overrides = config_overrides(overrides)
    for key, value in overrides.items():
        _set(config, key, value)
    if overrides and isinstance(getattr(config, "rope_parameters", None), dict):
        for params in _rope_dicts(config):
            if params.get("rope_type") in LENGTH_SCALING_ROPE_TYPES and trained_length is not None:
                # the length the weights were trained at, not a max_position_embeddings raised
                # beside the scaling (transformers would take that one)
                params.setdefault("original_max_position_embeddings", trained_length)
        config.standardize_rope_params()
        config.validate_rope()
    return config


def load_hf_config(model_path: str, overrides: Mapping[str, Any] | None = None):
    """The checkpoint's ``AutoConfig`` with ``overrides`` applied."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    return apply_overrides(config, overrides) if overrides else config


def _config_of(hf: dict):
    """The config class instance a checkpoint's config.json builds, or None when transformers
    does not know its model_type (an external_lib that registers it was not imported)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**hf)
    except (ValueError, KeyError, TypeError):
        return None


def _attribute_names(config) -> set[str]:
    cls = type(config)
    names = set(vars(config)) | {n for n in dir(cls) if isinstance(getattr(cls, n, None), property)}
    return names | {k for k in ROPE_PARAMETER_KEYS if _holds_rope_key(config, k)}


def override_errors(key: str, hf: dict, overrides: Mapping[str, Any]) -> list[str]:
    """One line per override the model cannot take: an unknown attribute (with the closest
    name), one the weights fix, or a value transformers refuses. ``hf`` is config.json's dict."""
    if not overrides:
        return []
    errors = _load_option_errors(key, load_options(overrides))
    overrides = config_overrides(overrides)
    if not overrides:
        return errors
    config = _config_of(hf)
    known = _attribute_names(config) if config is not None else set(hf)
    what = f"the model's config ({type(config).__name__})" if config is not None else "the model's config.json"
    for name in overrides:
        if name in SHAPE_KEYS:
            errors.append(f"{key}.{name}: the checkpoint's weights fix {name} (it is {hf.get(name)!r}): remove "
                          "the override, or use a checkpoint of that shape")
        elif name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"did you mean '{close[0]}'?" if close else "see config.json for the names"
            errors.append(f"{key}.{name} is not an attribute of {what}: {hint} (fix or remove it)")
    if errors or config is None:
        return errors
    try:
        apply_overrides(config, overrides)
    except Exception as err:  # transformers' own checks (rope parameters, read-only properties)
        reason = " ".join(str(err).split())
        errors.append(f"{key}={dict(overrides)} is refused by transformers ({type(err).__name__}: {reason}): fix "
                      "the values")
    return errors


def overridden_dict(hf: dict, overrides: Mapping[str, Any] | None) -> dict:
    """config.json's dict as the run sees it, for the size checks (shape keys are refused anyway)."""
    merged = dict(hf)
    for key, value in config_overrides(overrides).items():
        if key in SHAPE_KEYS:
            continue
        current = merged.get(key)
        merged[key] = _merged(current, value) if isinstance(current, Mapping) and isinstance(value, Mapping) else value
    return merged
