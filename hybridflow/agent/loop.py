"""The agent-loop interface: a token server, one trajectory's output, the base class of loops.

Tokens in, tokens out (issue 37): a trajectory's response ids are exactly the ids the server
generated plus the ids of the tool responses, in order. Earlier turns are never decoded and
re-encoded, so the trainer scores the very tokens that were sampled and the rollout's log-probs
stay comparable with the trainer's. Tool-response ids come from the chat template itself
(``chat.tool_response_ids``), so the model sees tool turns the way its template writes them.

The rollout runs one ``run`` per trajectory, all concurrently on one event loop: while one
trajectory waits on a tool, the others keep generating (no lockstep turns across the batch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from hybridflow.agent import chat
from hybridflow.agent.tools.base import BaseTool


@dataclass
class TokenOutput:
    """One generation: the sampled ids (the stop token included) and their log-probs."""

    token_ids: list[int]
    log_probs: list[float]


@runtime_checkable
class TokenServer(Protocol):
    """Generates one continuation of ``prompt_ids``.

    ``sampling_params`` keys: temperature, top_p, top_k, max_tokens. The server stops at EOS or the
    model's stop ids and returns the stop token included; it may return fewer than max_tokens ids.
    """

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict) -> TokenOutput:
        ...


@dataclass
class AgentLoopOutput:
    """One trajectory. ``response_mask`` is 1 on generated ids and 0 on tool/template ids;
    ``response_logprobs`` is 0.0 where the mask is 0. ``extra_fields["tool_outputs"]`` lists the
    tool texts that went into the conversation (after truncation), for the reward."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    num_turns: int
    metrics: dict[str, float] = field(default_factory=dict)
    extra_fields: dict = field(default_factory=dict)


# every loop reports these keys (and only these), so the rollout can stack them into batch columns
METRIC_KEYS = ("num_turns", "tool_calls", "tool_errors", "tool_timeouts", "parse_failures",
               "generated_tokens", "tool_tokens")


def zero_metrics() -> dict[str, float]:
    return {k: 0.0 for k in METRIC_KEYS}


@dataclass
class AgentSettings:
    """The loop's knobs, built by the rollout from ``actor_rollout_ref.rollout.multi_turn`` (verl's
    names). ``None`` turn limits mean unlimited (the token budget still ends the trajectory)."""

    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    response_length: int = 512
    format: str = "hermes"
    apply_chat_template_kwargs: dict = field(default_factory=dict)


class AgentLoopBase:
    """A loop over one trajectory. Subclasses implement ``run``; one instance serves one trajectory
    or many (keep per-trajectory state in ``run``'s locals, not on ``self``)."""

    def __init__(self, server: TokenServer, tokenizer, settings: AgentSettings, tools: dict[str, BaseTool]):
        self.server = server
        self.tokenizer = tokenizer
        self.settings = settings
        self.tools = dict(tools or {})

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict,
                       budget: int) -> TokenOutput:
        """One server call capped at ``budget`` new tokens; the output is cut to the budget and
        checked (one log-prob per id), so a misbehaving server fails loudly, not silently."""
        out = await self.server.generate(request_id, prompt_ids, {**sampling_params, "max_tokens": budget})
        ids, lps = list(out.token_ids)[:budget], list(out.log_probs)[:budget]
        if len(lps) != len(ids):
            raise ValueError(f"token server returned {len(ids)} ids but {len(lps)} log-probs for {request_id}")
        return TokenOutput(ids, [float(x) for x in lps])

    def tool_schemas(self) -> list[dict] | None:
        """OpenAI schemas of the tools, for the chat template (None when there are none)."""
        return [t.get_openai_tool_schema() for t in self.tools.values()] or None

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The chat template of the prompt with the tool schemas and the generation prompt."""
        return chat.prompt_ids(self.tokenizer, messages, self.tool_schemas(), self.settings.apply_chat_template_kwargs)

    async def run(self, sampling_params: dict, **row) -> AgentLoopOutput:
        """One trajectory. ``row``: the data row's non-tensor columns (``raw_prompt`` (chat
        messages), ``extra_info``, ``index``, ...) plus ``request_id``, unique per trajectory."""
        raise NotImplementedError(f"{type(self).__name__}.run")
