"""``reward_model`` (a learned scorer worker) and ``custom_reward_function`` (a user's rule)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.config.common import path_field


@dataclass
class RewardModelModelConfig:
    path: str | None = path_field(None)  # an HF *ForSequenceClassification checkpoint
    tokenizer_path: str | None = path_field(None)
    external_lib: str | None = None  # null: the actor's (verl's default), imported before the model loads


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment, applied by ``reward_manager=dapo``: responses longer than
    ``data.max_response_length - len`` tokens lose up to ``penalty_factor`` (linearly to the
    maximum length). ``log`` is verl's switch; the metrics are always logged here."""

    enable: bool = False
    len: int = 4096
    penalty_factor: float = 1.0
    log: bool = False


@dataclass
class RewardModelConfig:
    enable: bool = False
    # how custom_reward_function is called: naive (once per response) | batch (once per batch,
    # with lists) | dapo (as naive, plus overlong_buffer's length penalty);
    # hybridflow/rewards/manager.py. verl keeps these keys here too.
    reward_manager: str = "naive"
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: int = 8
    micro_batch_size: int | None = None  # verl's deprecated size over all data-parallel ranks
    # score with custom_reward_function in a Ray process of its own while the workers compute
    # log-probs and values (not with a reward model, or with algorithm.filter_groups: scored at once)
    launch_reward_fn_async: bool = False
    # verl's keys for a pool of the reward model's own (nnodes x n_gpus_per_node slots), whatever
    # trainer.placement does with the other roles; it scores while the actor's pool works
    enable_resource_pool: bool = False
    n_gpus_per_node: int = 0
    nnodes: int = 0


@dataclass
class CustomRewardFunctionConfig:
    """A user's ``compute_score`` by file path; None uses the built-in scorers by data_source."""

    path: str | None = path_field(None)
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    # seconds one call may take (once per sample; the batch manager's once per batch), > 0. Calls
    # run in a child process that is killed at the limit: that sample scores 0.0, counted in
    # reward/timeouts; a call past min(10 s, half the limit) is warned about while it runs.
    # null: no limit, calls run in the trainer's own process (hybridflow/rewards/scoring_process.py).
    # verl has no key for it (its prime manager cuts each call at a fixed 300 s).
    timeout_s: float | None = 60.0
