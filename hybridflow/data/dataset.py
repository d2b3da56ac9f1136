"""RL prompt data sets in verl's schema, read from parquet or jsonl.

A row is ``{"data_source": str, "prompt": [{"role", "content"}, ...] | str,
"reward_model": {"ground_truth": ...}, "extra_info": dict (optional)}``; other columns are kept
out of the batch. Every prompt is tokenized once, up front, so filtering is exact and its count
is known before training starts (verl filters the same way).

What differs from a plain text data set:
- A list of messages goes through the tokenizer's chat template with the generation prompt
  appended; a tokenizer without a template gets the message contents joined by newlines. A plain
  string is used verbatim unless ``apply_chat_template=true`` asks for the template (then it is one
  user message): verbatim is how a user feeds a base model raw text.
- Prompts are left-padded to ``max_prompt_length`` (the generation engine continues right after
  the last real token) and ``position_ids = clamp(cumsum(attention_mask) - 1, 0)``.
- Nothing is shortened silently: an overlong prompt is dropped (``filter_overlong_prompts``, the
  count is logged), or truncated only when ``truncation`` asks for it (the count is logged), or
  else it is an error naming the file, the row and the key.
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right")


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file, the row and the key."""


def read_rows(path: str) -> list[dict]:
    """All rows of one ``.parquet``, ``.jsonl`` or ``.json`` (one row per line, or one array of
    rows) file as plain Python dicts/lists. A file that cannot be read, or has no rows, raises a
    one-line DataError naming it: not a decoder's traceback, and not a count of rows filtered later."""
    if not os.path.exists(path):
        raise DataError(f"data file {path!r} does not exist: check data.train_files / data.val_files")
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".parquet", ".jsonl", ".json"):
        raise DataError(f"data file {path!r}: unsupported extension {ext!r}; use .parquet, .jsonl or .json")
    if os.path.getsize(path) == 0:
        raise DataError(f"data file {path} is empty (0 bytes): write its rows, or remove it from "
                        "data.train_files / data.val_files")
    rows = _read_parquet(path) if ext == ".parquet" else _read_json_rows(path, ext)
    if not rows:
        raise DataError(f"data file {path} has no rows: write its rows, or remove it from "
                        "data.train_files / data.val_files")
    return rows


def _read_parquet(path: str) -> list[dict]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        # to_pylist keeps nested lists/structs as Python lists/dicts (pandas would give ndarrays).
        return pq.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as err:  # truncated, or another format named .parquet
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        reason = re.sub(r"^Could not open Parquet input source '.*?': ", "", reason)  # the path is said once
        raise DataError(f"{path} is not a readable parquet file ({reason}): write it again (an interrupted copy "
                        "truncates it), or give a jsonl file a .jsonl name") from None


def _read_json_rows(path: str, ext: str) -> list[dict]:
    # bytes, decoded line by line, so a non-UTF-8 byte is reported with its line (a BOM is allowed)
    with open(path, "rb") as f:
        array = ext == ".json" and f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")
        f.seek(0)
        lines = (_utf8_line(path, raw, line_no) for line_no, raw in enumerate(f, start=1))
        if array:  # one JSON array of rows, not one row per line
            try:
                return json.loads("".join(lines))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {e.lineno} is not valid JSON ({e.msg})") from None
        rows = []
        for line_no, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {line_no} is not valid JSON ({e.msg}); "
                                "jsonl files need one JSON object per line") from None
        return rows


def _utf8_line(path: str, raw: bytes, line_no: int) -> str:
    try:
        return raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: line {line_no} is not UTF-8 text (byte {raw[e.start]:#04x} at column "
                        f"{e.start + 1}): save the file as UTF-8") from None


def _row_error(path: str, row: int, key: str, problem: str) -> DataError:
    return DataError(f"{path}: row {row}: key {key!r} {problem}")


def validate_row(row: Any, path: str, index: int, prompt_key: str, source_key: str = "data_source") -> None:
    """Raise a DataError naming file, row and key when ``row`` does not follow the schema.
    ``source_key`` (``data.reward_fn_key``) names the column that picks the reward function."""
    if not isinstance(row, Mapping):
        raise DataError(f"{path}: row {index} is a {type(row).__name__}, expected an object with "
                         f"keys {source_key}, {prompt_key}, reward_model")
    for key in (source_key, prompt_key, "reward_model"):
        if key not in row or row[key] is None:
            raise _row_error(path, index, key, "is missing")
    if not isinstance(row[source_key], str):
        raise _row_error(path, index, source_key, f"must be a string, got {type(row[source_key]).__name__}")
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        pass
    elif isinstance(prompt, Sequence) and len(prompt) > 0:
        for j, msg in enumerate(prompt):
            if not (isinstance(msg, Mapping) and isinstance(msg.get("role"), str)
                    and isinstance(msg.get("content"), str)):
                raise _row_error(path, index, prompt_key,
                                 f"message {j} must be {{'role': str, 'content': str}}, got {msg!r}")
    else:
        raise _row_error(path, index, prompt_key,
                         f"must be a string or a non-empty list of chat messages, got {prompt!r}")
    reward = row["reward_model"]
    if not isinstance(reward, Mapping) or reward.get("ground_truth") is None:
        raise _row_error(path, index, "reward_model", f"must be a dict with 'ground_truth', got {reward!r}")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        raise _row_error(path, index, "extra_info", f"must be a dict when present, got {type(extra).__name__}")


def prompt_text(tokenizer, prompt: str | Sequence[Mapping], apply_chat_template: bool | None = None,
                template_kwargs: Mapping | None = None) -> str:
    """The text the model sees for ``prompt`` (see the module docstring for the rules).

    ``apply_chat_template=None`` means: use the template when the tokenizer has one.
    ``template_kwargs`` (verl's ``data.apply_chat_template_kwargs``) reach the template's
    variables, e.g. ``enable_thinking=False`` for Qwen3.
    """
    if isinstance(prompt, str):
        if not apply_chat_template:  # None or False: raw text, as a base model is fed
            return prompt
        prompt = [{"role": "user", "content": prompt}]  # asked for: one user message, as verl's SFT does
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if apply_chat_template is None:
        apply_chat_template = has_template
    if apply_chat_template:
        if not has_template:
            raise DataError("data.apply_chat_template=True but the tokenizer has no chat_template: "
                             "set it to false or use a tokenizer with a template")
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **(template_kwargs or {}))
    return "\n".join(m["content"] for m in messages)


def encode_prompt(tokenizer, prompt: str | Sequence[Mapping], apply_chat_template: bool | None = None,
                  template_kwargs: Mapping | None = None) -> list[int]:
    """Token ids of one prompt, unpadded. The SFT trainer uses this too, so warm start and RL agree.

    Templated text already contains its special tokens (add_special_tokens=False, as verl does);
    raw text gets the tokenizer's usual ones (e.g. a Llama BOS), as a base model expects.
    """
    if isinstance(prompt, str):
        templated = bool(apply_chat_template)
    else:
        templated = (apply_chat_template if apply_chat_template is not None
                     else getattr(tokenizer, "chat_template", None) is not None)
    text = prompt_text(tokenizer, prompt, apply_chat_template, template_kwargs)
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


def pad_token_id(tokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)  # masked out anyway; verl makes the same choice
    raise DataError("tokenizer has neither pad_token nor eos_token: set tokenizer.pad_token")


def left_pad(ids: list[int], length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each [length] int64, real tokens at the right."""
    n = len(ids)
    input_ids = torch.full((length,), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(length, dtype=torch.long)
    if n:
        input_ids[length - n:] = torch.tensor(ids, dtype=torch.long)
        attention_mask[length - n:] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def _setting(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


class RLPromptDataset(torch.utils.data.Dataset):
    """Prompts of one or more parquet/jsonl files, tokenized and left-padded.

    ``dataset[i]`` is ``{"input_ids", "attention_mask", "position_ids"}`` ([P] int64 tensors) plus
    ``data_source`` (str), ``ground_truth``, ``extra_info`` (dict, ``{}`` when absent),
    ``raw_prompt`` (the row's prompt as given) and ``index`` (position among the kept rows), and
    ``agent_name`` when any row has one (the agent loop of the row, rollout.multi_turn). Attributes ``num_filtered`` and ``num_truncated`` count what the length policy did.
    """

    def __init__(self, files: str | Sequence[str], tokenizer, *, prompt_key: str = "prompt",
                 max_prompt_length: int = 512, filter_overlong_prompts: bool = True,
                 truncation: str = "error", apply_chat_template: bool | None = None, max_samples: int = -1,
                 reward_fn_key: str = "data_source", template_kwargs: Mapping | None = None):
        if isinstance(files, (str, os.PathLike)):
            files = [files]
        files = [os.fspath(f) for f in files]
        if not files:
            raise DataError("no data files given: set data.train_files (a path or a list of paths)")
        if max_prompt_length < 1:
            raise DataError(f"data.max_prompt_length={max_prompt_length}: must be a positive integer")
        if truncation not in TRUNCATION_MODES:
            raise DataError(f"data.truncation={truncation!r}: use one of {TRUNCATION_MODES}")
        self.files, self.tokenizer, self.prompt_key, self.reward_fn_key = files, tokenizer, prompt_key, reward_fn_key
        self.max_prompt_length = max_prompt_length
        self.pad_id = pad_token_id(tokenizer)
        self.num_filtered = self.num_truncated = 0
        # chat messages joined by newlines because the tokenizer has no template (warned once below)
        joined = 0 if apply_chat_template is None and getattr(tokenizer, "chat_template", None) is None else None
        self._rows: list[dict] = []
        self._ids: list[list[int]] = []
        for path in files:
            if len(self._rows) == max_samples:
                break
            for i, row in enumerate(read_rows(path)):
                if len(self._rows) == max_samples:  # verl's *_max_samples: the first kept rows
                    break
                validate_row(row, path, i, prompt_key, reward_fn_key)
                if joined is not None and not isinstance(row[prompt_key], str):
                    joined += 1
                ids = encode_prompt(tokenizer, row[prompt_key], apply_chat_template, template_kwargs)
                if not ids:  # generation needs at least one prompt token to continue from
                    raise _row_error(path, i, prompt_key, f"is {row[prompt_key]!r}, which tokenizes to no "
                                     "tokens: give the row a prompt or remove it")
                if len(ids) > max_prompt_length:
                    if filter_overlong_prompts:
                        self.num_filtered += 1
                        continue
                    if truncation == "error":
                        raise DataError(
                            f"{path}: row {i}: key {prompt_key!r} is {len(ids)} tokens, longer than "
                            f"data.max_prompt_length={max_prompt_length}: raise max_prompt_length, set "
                            "data.filter_overlong_prompts=true, or data.truncation='left'|'right'")
                    ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
                    self.num_truncated += 1
                self._rows.append(row)
                self._ids.append(ids)
        if joined:
            logger.warning("%d prompts of %s are chat messages but the tokenizer has no chat_template: their "
                           "contents were joined by newlines. If the model was trained with a template, give the "
                           "tokenizer one (actor_rollout_ref.model.custom_chat_template); data.apply_chat_template="
                           "false makes the joining explicit and silences this", joined, files)
        if self.num_filtered:
            logger.warning("dropped %d of %d prompts longer than data.max_prompt_length=%d (%s)",
                           self.num_filtered, self.num_filtered + len(self._rows), max_prompt_length, files)
        if self.num_truncated:
            logger.warning("truncated %d prompts (%s side) to data.max_prompt_length=%d (%s)",
                           self.num_truncated, truncation, max_prompt_length, files)
        # verl's agent_name column picks each row's agent loop (rollout.multi_turn); rows without it: null
        self.has_agent_name = any("agent_name" in row for row in self._rows)
        if not self._rows:
            raise DataError(f"no prompts left in {files} after filtering to data.max_prompt_length="
                             f"{max_prompt_length}: raise it")

    @classmethod
    def from_config(cls, files: str | Sequence[str], tokenizer, config: Any,
                    max_samples: int = -1) -> "RLPromptDataset":
        """Build from a data config (a mapping or an object with verl's key names); ``max_samples``
        (``data.train_max_samples`` / ``val_max_samples``) keeps the first kept rows, -1 all."""
        return cls(files, tokenizer, max_samples=max_samples,
                   reward_fn_key=_setting(config, "reward_fn_key", "data_source"),
                   prompt_key=_setting(config, "prompt_key", "prompt"),
                   max_prompt_length=_setting(config, "max_prompt_length", 512),
                   filter_overlong_prompts=_setting(config, "filter_overlong_prompts", True),
                   truncation=_setting(config, "truncation", "error"),
                   apply_chat_template=_setting(config, "apply_chat_template", None),
                   template_kwargs=_setting(config, "apply_chat_template_kwargs", None))

    def __len__(self) -> int:
        return len(self._rows)

    def data_sources(self) -> set:
        """The values of the column that picks each row's reward function (``reward_fn_key``)."""
        return {row[self.reward_fn_key] for row in self._rows}

    def prompt_ids(self, index: int) -> list[int]:
        """The unpadded token ids of row ``index``."""
        return list(self._ids[index])

    def __getitem__(self, index: int) -> dict:
        row = self._rows[index]
        input_ids, attention_mask, position_ids = left_pad(self._ids[index], self.max_prompt_length, self.pad_id)
        agent = {"agent_name": row.get("agent_name")} if self.has_agent_name else {}
        return agent | {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "data_source": row[self.reward_fn_key],
            "ground_truth": row["reward_model"]["ground_truth"],
            "extra_info": dict(row.get("extra_info") or {}),
            "raw_prompt": row[self.prompt_key],
            "index": index,
        }
