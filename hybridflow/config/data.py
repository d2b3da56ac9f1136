"""``data``: the prompt data set and the batch shape of one RL step (verl's key names)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config.keys import MAX_SAMPLES, OPTIONAL_POSITIVE, POSITIVE, Range, key


@dataclass
class DataConfig:
    train_files: list[str] = key(["data/arithmetic/train.parquet"], "parquet or jsonl files, verl's schema", path=True)
    val_files: list[str] = key(["data/arithmetic/val.parquet"], "validation files", path=True)
    prompt_key: str = key("prompt", "the prompt column", Range(bool, "a column name"))
    reward_fn_key: str = key("data_source", "the column that picks the reward function (passed as data_source)")
    max_prompt_length: int = key(32, "tokens of the longest prompt", POSITIVE)
    max_response_length: int = key(16, "tokens generated per response at most", POSITIVE)
    train_batch_size: int = key(8, "prompts per step (x rollout.n sequences)", POSITIVE)
    gen_batch_size: int | None = key(None, "prompts per generation batch; > train_batch_size only with "
                                           "algorithm.filter_groups; null: train_batch_size", OPTIONAL_POSITIVE)
    val_batch_size: int | None = key(None, "null: the whole validation set at once", OPTIONAL_POSITIVE)
    train_max_samples: int = key(-1, "the first N prompts (after length filtering); -1: all", MAX_SAMPLES)
    val_max_samples: int = key(-1, "as train_max_samples, for val_files", MAX_SAMPLES)
    filter_overlong_prompts: bool = key(True, "drop prompts longer than max_prompt_length")
    truncation: str = key("error", "error | left | right (when not filtering)", choices=("error", "left", "right"))
    apply_chat_template: bool | None = key(None, "null: chat-message prompts when the tokenizer has a template; "
                                                 "true: plain-string prompts too")
    apply_chat_template_kwargs: dict[str, Any] = key({}, "the template's variables, e.g. "
                                                         "+data.apply_chat_template_kwargs.enable_thinking=false")
    shuffle: bool = key(True, "shuffle the prompts each epoch")
    seed: int = key(0, "the shuffle's seed")
