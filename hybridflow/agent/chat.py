"""Chat-template arithmetic for agent loops: prompt ids, and the ids of a tool turn.

A tool turn's ids are the template's own rendering of the tool message(s) followed by the
generation prompt: the text the template writes after an assistant message's content when tool
messages follow it, in a fixed conversation (user, assistant with a sentinel content, tools). The
difference with the conversation up to the assistant's content is what gets encoded; the
trajectory's earlier ids are never decoded and re-encoded.

Why a fixed conversation and not the tool messages alone: many templates (Qwen2/2.5) insert a
default system prompt when the first message is not a system message, so templating the tool
messages by themselves would put a second system prompt into the trajectory.

The glue between the assistant's last token and the tool turn (Qwen's "\\n" after <|im_end|>) is
the rest of the template's closing of the assistant message; the generated ids already end with
the stop token, so only the rest is added.
"""
from __future__ import annotations

# assistant content used to find where the template closes an assistant message; plain letters so
# no template trims or escapes it
SENTINEL = "HybridflowAgentSentinel"


def as_messages(prompt) -> list[dict]:
    """A row's ``raw_prompt``: chat messages, or a plain string taken as one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def render(tokenizer, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
           template_kwargs: dict | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, **(template_kwargs or {}))


def encode(tokenizer, text: str) -> list[int]:
    """Ids of template text. No special tokens added: the template writes its own (as HF's
    apply_chat_template(tokenize=True) does)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(tokenizer, messages, tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
    return encode(tokenizer, render(tokenizer, as_messages(messages), tools, True, template_kwargs))


class ToolTurnTemplate:
    """Ids of tool turns for one tokenizer, tool list and template kwargs (build once, reuse).

    Raises ValueError at construction when the template cannot be used this way (it drops the
    assistant's content, or cannot render a tool message after an assistant message), so a bad
    template fails before any trajectory runs.
    """

    def __init__(self, tokenizer, tools: list[dict] | None = None, template_kwargs: dict | None = None):
        self.tokenizer, self.tools, self.template_kwargs = tokenizer, tools, dict(template_kwargs or {})
        self.base = [{"role": "user", "content": "1"}, {"role": "assistant", "content": SENTINEL}]
        try:
            self.turn_text([{"role": "tool", "content": "0"}])  # fails here, not mid-rollout
        except ValueError:
            raise
        except Exception as e:  # jinja's errors, or the template's own raise_exception
            raise ValueError(f"the chat template cannot render a tool message after an assistant message "
                             f"({type(e).__name__}: {e}); the agent loop needs one that can") from None

    def turn_text(self, tool_messages: list[dict]) -> str:
        """What the template writes after an assistant message's content when ``tool_messages``
        follow it: the rest of the assistant's closing, the tool turn and the generation prompt.

        Only text after the assistant's content is used, so whatever the template puts before it
        (a default system prompt, a rendering of earlier turns that depends on what follows, as
        Qwen3's think blocks do) cannot leak into the tool turn.
        """
        full = render(self.tokenizer, self.base + tool_messages, self.tools, True, self.template_kwargs)
        at = full.find(SENTINEL)
        if at < 0:
            raise ValueError("the chat template does not write an assistant message's content; the agent loop "
                             "needs a template that renders assistant and tool messages")
        return full[at + len(SENTINEL):]

    def ids(self, tool_texts: list[str], last_generated_id: int | None) -> list[int]:
        """Ids to append after a generated turn (ending with ``last_generated_id``) for these tool results.

        The turn ended with a stop token: when the template's closing starts with it (Qwen's
        "<|im_end|>" of "<|im_end|>\\n"), only the rest is added; a model that stopped on another
        token gets the whole closing.
        """
        text = self.turn_text([{"role": "tool", "content": t} for t in tool_texts])
        last = "" if last_generated_id is None else self.tokenizer.decode([last_generated_id], skip_special_tokens=False)
        if last and text.startswith(last):
            text = text[len(last):]
        return encode(self.tokenizer, text)


def truncate_tool_text(text: str, limit: int, side: str = "middle") -> str:
    """Cut a tool's text to ``limit`` characters (verl's tool_response_truncate_side): ``left`` keeps
    the start, ``right`` keeps the end, ``middle`` keeps both ends; a marker says text was cut."""
    if limit <= 0 or len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    if side == "middle":
        half = limit // 2
        return text[:half] + "...(truncated)..." + text[len(text) - (limit - half):]
    raise ValueError(f"tool_response_truncate_side={side!r}: use left, right or middle")
