"""The tool base class (verl's ``BaseTool`` shape) that the agent loop calls.

A tool is built once per rollout worker from its entry in the tool config (``config`` and
``tool_schema``, an OpenAI function schema) and then serves many trajectories at once. State a
trajectory needs (a sandbox, a counter) lives under the instance id that ``create`` returns and is
dropped in ``release``; the loop calls ``release`` in a ``finally``, so it runs even when the
trajectory fails.

``execute`` is a coroutine and runs on the rollout's event loop, next to every other trajectory's
generation: a tool that does blocking work (a subprocess, a slow library call, heavy CPU) must
hand it off, e.g. ``await asyncio.to_thread(fn, ...)``, or every trajectory waits for it. The loop
bounds each call with ``asyncio.wait_for(..., timeout_s)``; a blocking call cannot be cut that way.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 10.0


@dataclass
class ToolResponse:
    """What a tool hands back to the conversation: the text of the tool message."""

    text: str


class BaseTool:
    """Subclass and override ``execute`` (and ``create``/``release`` for per-trajectory state).

    ``config``: the entry's ``config`` mapping (``type: native``, ``timeout_s``, anything the tool
    reads); ``tool_schema``: ``{"type": "function", "function": {"name", "description",
    "parameters"}}``, given to the chat template so the model sees the tool.
    """

    def __init__(self, config: dict, tool_schema: dict):
        self.config = dict(config or {})
        self.tool_schema = tool_schema
        self.name: str = tool_schema["function"]["name"]
        self.timeout_s: float = float(self.config.get("timeout_s", DEFAULT_TIMEOUT_S))

    def get_openai_tool_schema(self) -> dict:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs) -> str:
        """Start a trajectory's instance; returns its id (a fresh uuid when none is given)."""
        return instance_id or uuid.uuid4().hex

    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple[ToolResponse, float | None, dict]:
        """Run one call: (response, a step reward or None, metrics). The loop catches what this raises."""
        raise NotImplementedError(f"{type(self).__name__}.execute")

    async def release(self, instance_id: str, **kwargs) -> None:
        """Drop the instance's state. Called once per ``create``, also after a failure."""
