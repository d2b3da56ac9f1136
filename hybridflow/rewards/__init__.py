"""Rule rewards and user reward functions, tokenizer-free (strings in, scores out).

Built-in scorers by data_source: `registry.RULE_SCORERS`. User functions: `loader.py`.
Batch scoring into token-level scores: `manager.RewardManager`.
"""

from hybridflow.rewards.loader import RewardFunctionError, load_reward_function
from hybridflow.rewards.manager import RewardManager, RewardResult, make_reward_manager
from hybridflow.rewards.registry import RULE_SCORERS, default_compute_score, get_rule_scorer

__all__ = [
    "RULE_SCORERS", "RewardFunctionError", "RewardManager", "RewardResult", "default_compute_score", "get_rule_scorer",
    "load_reward_function", "make_reward_manager",
]
