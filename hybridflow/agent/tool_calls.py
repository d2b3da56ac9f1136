"""Hermes-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

The format Qwen2/2.5 (and the Hermes models) are trained to emit. A block that does not parse is
a failure: counted, so the trainer can log how often the policy writes broken calls, never raised.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass
class FunctionCall:
    name: str
    arguments: dict


@dataclass
class ParsedCalls:
    """``content``: the text outside the blocks (stripped); ``calls`` in order; ``failures``: blocks
    that were malformed, plus an opened block never closed."""

    content: str
    calls: list[FunctionCall] = field(default_factory=list)
    failures: int = 0


def _call(body: str) -> FunctionCall | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", None)
    if isinstance(args, str):  # OpenAI's wire format sends arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return FunctionCall(obj["name"], args)


def parse_tool_calls(text: str) -> ParsedCalls:
    calls, failures, last_end = [], 0, 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1).strip())
        if call is None:
            failures += 1
        else:
            calls.append(call)
        last_end = m.end()
    if OPEN in text[last_end:]:  # the model began a call and never closed it
        failures += 1
    content = _BLOCK.sub("", text)
    if OPEN in content:
        content = content[:content.index(OPEN)]
    return ParsedCalls(content.strip(), calls, failures)
