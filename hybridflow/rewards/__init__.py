"""Rule rewards and user reward functions, tokenizer-free (strings in, scores out).

Built-in scorers by data_source: `registry.RULE_SCORERS`. User functions: `loader.py`.
Batch scoring into token-level scores: `manager.RewardManager`; each call bounded in a child
process: `scoring_process.py`.

The names below are imported when first used (PEP 562), not with the package: the scoring child
process imports the built-in scorers through this package and must not pay for torch (which the
manager imports) at every start.
"""
from __future__ import annotations

import importlib

_WHERE = {
    "RewardFunctionError": "loader", "load_reward_function": "loader",
    "RewardManager": "manager", "RewardResult": "manager", "make_reward_manager": "manager",
    "RULE_SCORERS": "registry", "default_compute_score": "registry", "get_rule_scorer": "registry",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
