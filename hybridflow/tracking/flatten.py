"""Flatten a nested config dict into dotted keys (`actor_rollout_ref.rollout.n`)."""
from __future__ import annotations

from typing import Any


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts become dotted keys; lists and scalars are leaves (kept as they are).

    An empty dict is kept as a leaf so a setting that is present-but-empty stays visible.
    """
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            flat.update(flatten_config(value, name))
        else:
            flat[name] = value
    return flat
