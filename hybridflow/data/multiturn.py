"""A conversation as SFT trains on it (verl's ``data.multiturn``): every assistant turn is a target.

The conversation goes through the tokenizer's chat template once. Each assistant message's tokens
are found as the difference between the templated conversation up to that message and the
templated conversation before it with the generation prompt (``<|im_start|>assistant\\n``):
those tokens, the end-of-turn marker included, are what the model must learn to produce; system,
user and tool turns are context. In the RL batch layout the SFT engine reads, everything before
the first assistant turn is the prompt and the rest is the response, whose mask marks the
assistant tokens only.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from hybridflow.data.dataset import DataError


def _ids(tokenizer, messages, generation_prompt: bool, template_kwargs: Mapping) -> list[int]:
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, tokenize=True,
                                        **template_kwargs)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def encode_conversation(tokenizer, messages: Sequence[Mapping], where: str,
                        template_kwargs: Mapping | None = None) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, response_ids, loss_mask)`` of one conversation (``loss_mask`` over the response)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where}: data.multiturn needs a tokenizer with a chat template")
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages or not all(
            isinstance(m, Mapping) and "role" in m and "content" in m for m in messages):
        raise DataError(f"{where}: data.multiturn.messages_key must hold a list of {{role, content}} messages")
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    kwargs = dict(template_kwargs or {})
    full = _ids(tokenizer, messages, False, kwargs)
    spans = []
    if messages[0]["role"] == "assistant":  # its header cannot be told apart: no conversation before it
        raise DataError(f"{where}: the conversation opens with an assistant turn; open it with a system or "
                        "user message")
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _ids(tokenizer, messages[:i], True, kwargs)  # up to and with the assistant header
        head = _ids(tokenizer, messages[:i + 1], False, kwargs)
        if full[:len(head)] != head or full[:len(before)] != before or len(before) > len(head):
            # e.g. a template that rewrites earlier turns once later ones exist
            raise DataError(f"{where}: the chat template does not render turn {i} as a prefix of the whole "
                            "conversation, so its assistant tokens cannot be located")
        spans.append((len(before), len(head)))
    if not spans:
        raise DataError(f"{where}: the conversation has no assistant message to train on")
    first = spans[0][0]
    mask = [0] * (len(full) - first)
    for start, end in spans:
        mask[start - first:end - first] = [1] * (end - start)
    return full[:first], full[first:], mask
