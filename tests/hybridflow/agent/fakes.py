"""A scripted TokenServer and tools that misbehave on purpose, for the agent-loop tests."""
from __future__ import annotations

import asyncio

from hybridflow.agent.loop import TokenOutput
from hybridflow.agent.tools.base import BaseTool, ToolResponse


def call(name: str, **arguments) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class ScriptedServer:
    """Answers each generate with the next scripted turn of its request's trajectory: the text's
    ids plus the stop id (unless ``stop`` is False), cut at max_tokens as a real server would.
    Log-probs are distinct per token so the tests can see they travel untouched. Records every call."""

    def __init__(self, tokenizer, turns: dict[str, list] | list, stop_id: int | None = None):
        self.tok = tokenizer
        self.turns = turns
        self.stop_id = tokenizer.eos_token_id if stop_id is None else stop_id
        self.calls: list[dict] = []
        self.counter = 0

    def script(self, request_id: str) -> list:
        return self.turns if isinstance(self.turns, list) else self.turns[request_id.rsplit("-", 1)[0]]

    async def generate(self, request_id, prompt_ids, sampling_params):
        turn = int(request_id.rsplit("-", 1)[1])
        text = self.script(request_id)[turn]
        ids = self.tok.encode(text, add_special_tokens=False) + [self.stop_id]
        ids = ids[: sampling_params["max_tokens"]]
        lps = [-(self.counter + i + 1) / 1000 for i in range(len(ids))]
        self.counter += len(ids)
        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids), "params": dict(sampling_params),
                           "ids": ids, "log_probs": lps})
        await asyncio.sleep(0)  # let other trajectories interleave, as a real server's awaits do
        return TokenOutput(ids, lps)


def schema(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": name,
                                             "parameters": {"type": "object", "properties": {}}}}


class RecordingTool(BaseTool):
    """Echoes its arguments after ``delay`` s; records creates, releases and the peak of concurrent calls."""

    def __init__(self, name="echo", delay=0.0, timeout_s=10.0):
        super().__init__({"timeout_s": timeout_s}, schema(name))
        self.delay, self.created, self.released, self.in_flight, self.peak = delay, [], [], 0, 0

    async def create(self, instance_id=None, **kwargs):
        iid = f"inst{len(self.created)}"
        self.created.append((iid, kwargs))
        return iid

    async def execute(self, instance_id, parameters, **kwargs):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        return ToolResponse(f"{instance_id}:{sorted(parameters.items())}"), 0.5, {}

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)


class RaisingTool(BaseTool):
    def __init__(self, name="boom"):
        super().__init__({}, schema(name))

    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("disk on fire")


class HangingTool(BaseTool):
    def __init__(self, name="hang", timeout_s=0.05):
        super().__init__({"timeout_s": timeout_s}, schema(name))

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(60)


class GarbageTool(BaseTool):
    """Returns the wrong types: a bare string, or a ToolResponse whose text is not text."""

    def __init__(self, name="junk", result=None):
        super().__init__({}, schema(name))
        self.result = result

    async def execute(self, instance_id, parameters, **kwargs):
        return self.result
