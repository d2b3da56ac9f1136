"""``reward_model`` (a learned scorer worker) and ``custom_reward_function`` (a user's rule)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.config.common import path_field


@dataclass
class RewardModelModelConfig:
    path: str | None = path_field(None)  # an HF *ForSequenceClassification checkpoint
    tokenizer_path: str | None = path_field(None)


@dataclass
class RewardModelConfig:
    enable: bool = False
    # how custom_reward_function is called: naive (once per response) | batch (once per batch,
    # with lists; hybridflow/rewards/manager.py). verl keeps this key here too.
    reward_manager: str = "naive"
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: int = 8


@dataclass
class CustomRewardFunctionConfig:
    """A user's ``compute_score`` by file path; None uses the built-in scorers by data_source."""

    path: str | None = path_field(None)
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
