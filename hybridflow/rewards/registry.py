"""The built-in rule rewards, chosen by each sample's `data_source`.

Every scorer here and every user reward function has verl's signature

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

(a dict must hold the reward under "score"; its other keys become metrics).
`RULE_SCORERS` lists every data_source this file knows; another source needs a user function
(`custom_reward_function.path` / `.name`, see loader.py).
"""

from __future__ import annotations

from typing import Any, Callable

from hybridflow.rewards import arithmetic, count, gsm8k, tool_arithmetic

ScoreResult = float | dict[str, Any]
ComputeScoreFn = Callable[..., ScoreResult]
RuleScorer = Callable[[str, Any], float]

RULE_SCORERS: dict[str, RuleScorer] = {
    "arithmetic": arithmetic.compute_score,
    "count": count.compute_score,  # the long-tail workload (hybridflow.data.count): partial credit
    "gsm8k": gsm8k.compute_score,  # strict "####" extraction, as in verl
    "openai/gsm8k": gsm8k.compute_score,
    "tool_arithmetic": tool_arithmetic.compute_score,  # the tool-use demo (hybridflow.data.tool_arithmetic)
}


def get_rule_scorer(data_source: str) -> RuleScorer:
    """The built-in scorer for `data_source`; ValueError naming the known sources otherwise."""
    try:
        return RULE_SCORERS[data_source]
    except (KeyError, TypeError):
        raise ValueError(
            f"no built-in reward for data_source {data_source!r}; known: {sorted(RULE_SCORERS)}. "
            "Set custom_reward_function.path (and .name) to a file defining "
            "compute_score(data_source, solution_str, ground_truth, extra_info=None)"
        ) from None


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict | None = None) -> float:
    """Dispatch to the built-in scorer of `data_source` (extra_info is unused by them)."""
    return get_rule_scorer(data_source)(solution_str, ground_truth)
