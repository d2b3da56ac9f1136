"""Prompt/response pairs for supervised fine-tuning, laid out exactly like an RL batch.

The prompt is tokenized the way the RL data set does it (``encode_prompt``) and left-padded to
``P``, the longest prompt; the response (plus EOS) is right-padded to ``R``, the longest response.
Each row's prompt + response must fit ``max_length`` (else ``truncation``: ``error`` names the row,
``left`` drops the prompt's first tokens, ``right`` the response's last, as verl's SFT data set
does for the joined sequence); rows are not held to one another's lengths. So the SFT loss is the
training engine's response log-prob, the same code path as PPO, and a warm-started model sees
prompts at RL time exactly as it saw them here.
"""
from __future__ import annotations

import logging

import torch

from hybridflow.data.dataset import DataError, encode_prompt, left_pad, pad_token_id, read_rows
from hybridflow.data.multiturn import encode_conversation

logger = logging.getLogger(__name__)

SFT_TENSOR_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


class SFTDataset(torch.utils.data.Dataset):
    def __init__(self, files, tokenizer, *, prompt_key: str = "prompt", response_key: str = "response",
                 max_length: int = 64, apply_chat_template: bool | None = None, truncation: str = "error",
                 messages_key: str | None = None, prompt_dict_keys=None, response_dict_keys=None):
        """``messages_key`` set: each row is a conversation (verl's ``data.multiturn``), every
        assistant turn a target (``hybridflow/data/multiturn.py``); else a prompt/response pair.
        ``*_dict_keys`` (verl's): the column holds a dict, and these keys lead to the text inside
        (``prompt_key=extra_info, prompt_dict_keys=[question]`` reads ``row["extra_info"]["question"]``)."""
        files = [files] if isinstance(files, str) else list(files)
        if tokenizer.eos_token_id is None:
            raise DataError("SFT needs a tokenizer with an eos_token: responses must teach the model to stop")
        self.pad_id = pad_token_id(tokenizer)
        rows = []
        for path in files:
            for i, row in enumerate(read_rows(path)):
                where = f"{path}: row {i}"
                if messages_key is not None:
                    if messages_key not in row:
                        raise DataError(f"{where}: missing key {messages_key!r} (data.multiturn.messages_key)")
                    prompt, response, loss = encode_conversation(tokenizer, row[messages_key], where)
                else:
                    prompt, response = self._pair(tokenizer, row, (prompt_key, prompt_dict_keys),
                                                  (response_key, response_dict_keys), apply_chat_template, where)
                    loss = [1] * len(response)
                rows.append(_fit(prompt, response, loss, max_length, truncation, where))
        if not rows:
            raise DataError(f"no SFT rows in {files}")
        self.truncated = sum(1 for *_, cut in rows if cut)
        if self.truncated:
            logger.warning("SFT data: %d of %d rows truncated to data.max_length=%d (data.truncation=%s)",
                           self.truncated, len(rows), max_length, truncation)
        self.rows = [(p, r, m) for p, r, m, _ in rows]
        self.prompt_length = max(len(p) for p, _, _ in self.rows)
        self.response_length = max(len(r) for _, r, _ in self.rows)

    @staticmethod
    def _pair(tokenizer, row, prompt_keys, response_keys, apply_chat_template, where):
        prompt_text, response_text = _field(row, *prompt_keys, where), _field(row, *response_keys, where)
        if not isinstance(response_text, str):
            raise DataError(f"{where}: the response ({_path(*response_keys)}) must be a string")
        prompt = encode_prompt(tokenizer, prompt_text, apply_chat_template)
        response = list(tokenizer(response_text, add_special_tokens=False)["input_ids"])
        return prompt, response + [tokenizer.eos_token_id]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        prompt, response, loss = self.rows[index]
        p_ids, p_mask, _ = left_pad(prompt, self.prompt_length, self.pad_id)
        r_ids = torch.full((self.response_length,), self.pad_id, dtype=torch.long)
        r_mask = torch.zeros(self.response_length, dtype=torch.long)
        r_loss = torch.zeros(self.response_length, dtype=torch.long)
        r_ids[: len(response)] = torch.tensor(response)
        r_mask[: len(response)] = 1
        r_loss[: len(response)] = torch.tensor(loss)
        mask = torch.cat([p_mask, r_mask])
        return {"input_ids": torch.cat([p_ids, r_ids]), "attention_mask": mask,
                "position_ids": (mask.cumsum(0) - 1).clamp(min=0), "responses": r_ids, "response_mask": r_loss}


def _path(key: str, dict_keys) -> str:
    return ".".join([key, *(dict_keys or [])])


def _field(row, key: str, dict_keys, where: str):
    value = row
    for part in [key, *(dict_keys or [])]:
        if not isinstance(value, dict) or part not in value:
            raise DataError(f"{where}: missing key {_path(key, dict_keys)!r} (data.prompt_key / data.response_key"
                            + (", data.*_dict_keys)" if dict_keys else ")"))
        value = value[part]
    return value


def _fit(prompt: list[int], response: list[int], loss: list[int], max_length: int, truncation: str, where: str):
    """``(prompt, response, loss_mask, truncated)`` within ``max_length`` tokens, by ``truncation``."""
    excess = len(prompt) + len(response) - max_length
    if excess <= 0:
        return prompt, response, loss, False
    if truncation == "left" and excess < len(prompt):
        return prompt[excess:], response, loss, True
    if truncation == "right" and excess < len(response) and any(loss[:-excess]):
        return prompt, response[:-excess], loss[:-excess], True
    hint = {"left": "the response alone does not fit with a prompt token: raise data.max_length",
            "right": "the prompt alone leaves no room for a response token: raise data.max_length"}.get(
        truncation, "raise data.max_length or set data.truncation=left|right")
    raise DataError(f"{where}: prompt+response is {len(prompt) + len(response)} tokens, longer than "
                    f"data.max_length={max_length}: {hint}")


def collate_sft(items) -> dict:
    return {k: torch.stack([it[k] for it in items]) for k in SFT_TENSOR_KEYS}
