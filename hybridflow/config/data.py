"""``data``: the prompt data set and the batch shape of one RL step (verl's key names).

``train_batch_size`` counts prompts; each step trains on ``train_batch_size * rollout.n``
sequences. ``val_batch_size`` None means the whole validation set in one generation call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.config.common import PATH


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["data/arithmetic/train.parquet"],
                                   metadata=PATH)
    val_files: list[str] = field(default_factory=lambda: ["data/arithmetic/val.parquet"],
                                 metadata=PATH)
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"  # the column that picks the reward function (passed as data_source)
    max_prompt_length: int = 32
    max_response_length: int = 16
    train_batch_size: int = 8
    # prompts generated per batch; more than train_batch_size only with algorithm.filter_groups
    # (DAPO: generate extra, keep train_batch_size prompts whose samples differ). null: train_batch_size
    gen_batch_size: int | None = None
    val_batch_size: int | None = None
    train_max_samples: int = -1  # the first N prompts of train_files (after length filtering); -1: all
    val_max_samples: int = -1
    filter_overlong_prompts: bool = True
    truncation: str = "error"  # error | left | right (only when not filtering)
    apply_chat_template: bool | None = None  # None: when the tokenizer has a template
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # the template's variables
    # verl's loader worker processes; prompts are tokenized once at start-up here and the loader
    # only indexes them, so there is nothing for worker processes to do: any value runs the same
    dataloader_num_workers: int = 0
    shuffle: bool = True
    seed: int = 0
    # verl's key (verl re-templates the raw chat for a reward model with its own tokenizer), kept
    # so verl commands run. Here the reward model shares the actor's tokenizer and every row
    # carries its raw chat anyway (raw_prompt): true or false changes nothing
    return_raw_chat: bool = False
