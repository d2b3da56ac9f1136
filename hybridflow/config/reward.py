"""``reward_model`` (a learned scorer worker) and ``custom_reward_function`` (a user's rule)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config.actor_rollout_ref import DEPRECATED_GLOBAL
from hybridflow.config.keys import OPTIONAL_GT_0, POSITIVE, Range, Registry, key


@dataclass
class RewardModelModelConfig:
    path: str | None = key(None, "an HF *ForSequenceClassification checkpoint", path=True)
    tokenizer_path: str | None = key(None, "null: the tokenizer saved with the model", path=True)
    external_lib: str | None = key(None, "null: actor_rollout_ref.model.external_lib (verl's default)")


@dataclass
class OverlongBufferConfig:
    enable: bool = key(False, "penalise responses that run into the last len tokens")
    len: int = key(4096, "the penalty grows over the last len tokens before data.max_response_length")
    penalty_factor: float = key(1.0, "the penalty at the maximum length")


@dataclass
class RewardModelConfig:
    enable: bool = key(False, "score with a reward model worker")
    reward_manager: str = key("naive", "naive: custom_reward_function per response | batch: once per batch, with "
                                       "lists | dapo: naive + overlong_buffer (hybridflow/rewards/manager.py)",
                              choices=Registry("REWARD_MANAGERS", "hybridflow.rewards.manager"))
    overlong_buffer: OverlongBufferConfig = key(OverlongBufferConfig(), "reward_manager=dapo: DAPO's soft "
                                                                        "overlong punishment")
    model: RewardModelModelConfig = key(RewardModelModelConfig(), "the reward model")
    micro_batch_size_per_gpu: int = key(8, "rows per forward on one worker", POSITIVE)
    micro_batch_size: int | None = key(None, DEPRECATED_GLOBAL)
    launch_reward_fn_async: bool = key(False, "score in a Ray process of its own while the workers compute "
                                              "log-probs and values")
    enable_resource_pool: bool = key(False, "true: the reward model gets its own pool, nnodes x n_gpus_per_node slots")
    n_gpus_per_node: int = key(0, "with enable_resource_pool: slots per node (a positive integer)")
    nnodes: int = key(0, "with enable_resource_pool: nodes (a positive integer)")


@dataclass
class CustomRewardFunctionConfig:
    path: str | None = key(None, "a .py file defining compute_score(data_source, solution_str, ground_truth, "
                                 "extra_info=None); null: built-in scorers by data_source", path=True)
    name: str = key("compute_score", "the function's name in that file", Range(bool, "a function name"))
    reward_kwargs: dict[str, Any] = key({}, "extra keyword arguments of each call")
    timeout_s: float | None = key(60.0, "seconds per call, in a child process (killed past it: scores 0, "
                                        "counted in reward/timeouts); null: no limit, in-process", OPTIONAL_GT_0)
