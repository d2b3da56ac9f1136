"""``tool_agent``: generate -> parse tool calls -> run the tools -> append their turn -> generate ...

One trajectory per ``run``, all trajectories concurrent on one event loop (verl's ToolAgentLoop).
Token ids only grow by appending: the generated ids (mask 1, the server's log-probs) and the
template's ids of each tool turn (mask 0, log-prob 0), so what the trainer scores is exactly what
was sampled plus what the tools said (issue 37, "tokens in, tokens out").

The trajectory stops when a turn has no tool call (EOS or plain text), when max_assistant_turns or
max_user_turns is reached, or when response_length tokens are used up (a tool turn that does not
fit is cut there). The last generated turn keeps its stop token.

Tools never crash a trajectory: an unknown tool, a tool that raises, one that runs past its
``timeout_s`` (``asyncio.wait_for``) or one that returns something other than a ToolResponse puts
an "Error: ..." text into the conversation and counts in ``tool_errors``/``tool_timeouts``.
"""
from __future__ import annotations

import asyncio
import logging

from hybridflow.agent.chat import ToolTurnTemplate, truncate_tool_text
from hybridflow.agent.loop import AgentLoopBase, AgentLoopOutput, zero_metrics
from hybridflow.agent.tool_calls import FunctionCall, parse_tool_calls
from hybridflow.agent.tools.base import BaseTool, ToolResponse

logger = logging.getLogger(__name__)
FORMATS = ("hermes",)


class ToolAgentLoop(AgentLoopBase):
    def __init__(self, server, tokenizer, settings, tools: dict[str, BaseTool]):
        super().__init__(server, tokenizer, settings, tools)
        if settings.format not in FORMATS:
            raise ValueError(f"multi_turn.format={settings.format!r}: use one of {', '.join(FORMATS)}")
        if settings.max_parallel_calls < 1:
            raise ValueError(f"multi_turn.max_parallel_calls={settings.max_parallel_calls}: give at least 1")
        # built now, so a template that cannot append tool turns fails before any trajectory runs
        self.turn_template = ToolTurnTemplate(tokenizer, self.tool_schemas(), settings.apply_chat_template_kwargs)

    async def run(self, sampling_params: dict, **row) -> AgentLoopOutput:
        s, request_id = self.settings, row["request_id"]
        tools_kwargs = (row.get("extra_info") or {}).get("tools_kwargs") or {}  # verl: {name: {create_kwargs, execute_kwargs}}
        prompt = self.prompt_ids(row["raw_prompt"])
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        metrics = zero_metrics()
        outputs: list[str] = []
        rewards: list[float] = []
        instances: dict[str, str] = {}
        assistant_turns = user_turns = 0
        stop = "budget"
        try:
            while len(ids) < s.response_length:
                left = s.response_length - len(ids)
                out = await self.generate(f"{request_id}-{assistant_turns}", prompt + ids, sampling_params, left)
                ids += out.token_ids
                mask += [1] * len(out.token_ids)
                logprobs += out.log_probs
                assistant_turns += 1
                if len(out.token_ids) >= left:
                    stop = "budget"
                    break
                parsed = parse_tool_calls(self.tokenizer.decode(out.token_ids, skip_special_tokens=False))
                metrics["parse_failures"] += parsed.failures
                if not parsed.calls:
                    stop = "no_tool_call"
                    break
                if s.max_assistant_turns and assistant_turns >= s.max_assistant_turns:
                    stop = "max_assistant_turns"
                    break
                if s.max_user_turns and user_turns >= s.max_user_turns:
                    stop = "max_user_turns"
                    break
                calls = parsed.calls[: s.max_parallel_calls]
                await self._create_instances(calls, instances, tools_kwargs, request_id)
                results = await asyncio.gather(*(self._call(c, instances, tools_kwargs, metrics) for c in calls))
                texts = [truncate_tool_text(text, s.max_tool_response_length, s.tool_response_truncate_side)
                         for text, _ in results]
                outputs += texts
                rewards += [r for _, r in results if r is not None]
                metrics["tool_calls"] += len(calls)
                user_turns += 1
                tool_ids = self.turn_template.ids(texts, out.token_ids[-1])[: s.response_length - len(ids)]
                ids += tool_ids
                mask += [0] * len(tool_ids)
                logprobs += [0.0] * len(tool_ids)
        finally:
            await self._release(instances, request_id)
        metrics.update(num_turns=float(1 + assistant_turns + user_turns), generated_tokens=float(sum(mask)),
                       tool_tokens=float(len(mask) - sum(mask)))
        return AgentLoopOutput(prompt_ids=prompt, response_ids=ids, response_mask=mask, response_logprobs=logprobs,
                               num_turns=1 + assistant_turns + user_turns, metrics=metrics,
                               extra_fields={"tool_outputs": outputs, "tool_rewards": rewards, "stop_reason": stop})

    async def _create_instances(self, calls: list[FunctionCall], instances: dict, tools_kwargs: dict, request_id: str):
        """One instance per tool per trajectory, made on the tool's first call (before the calls run
        concurrently, so two calls of one tool share it). A failed create leaves the tool without an
        instance; its calls then report the failure."""
        for name in dict.fromkeys(c.name for c in calls):
            tool = self.tools.get(name)
            if tool is None or name in instances:
                continue
            kwargs = (tools_kwargs.get(name) or {}).get("create_kwargs") or {}
            try:
                instances[name] = await asyncio.wait_for(tool.create(None, **kwargs), tool.timeout_s)
            except Exception as e:  # a broken create is the tool's failure, not the trajectory's
                instances[name] = e

    async def _call(self, call: FunctionCall, instances: dict, tools_kwargs: dict, metrics: dict):
        """(text for the conversation, step reward or None). Never raises for a tool's fault."""
        tool = self.tools.get(call.name)
        if tool is None:
            metrics["tool_errors"] += 1
            return f"Error: no tool named {call.name!r}; available: {', '.join(self.tools) or 'none'}", None
        instance = instances.get(call.name)
        if isinstance(instance, BaseException):
            metrics["tool_errors"] += 1
            return f"Error: {call.name} could not start: {type(instance).__name__}: {instance}", None
        kwargs = (tools_kwargs.get(call.name) or {}).get("execute_kwargs") or {}
        try:
            result = await asyncio.wait_for(tool.execute(instance, call.arguments, **kwargs), tool.timeout_s)
        except asyncio.TimeoutError:
            metrics["tool_timeouts"] += 1
            return f"Error: {call.name} timed out after {tool.timeout_s:g} s", None
        except Exception as e:
            metrics["tool_errors"] += 1
            return f"Error: {call.name} failed: {type(e).__name__}: {e}", None
        response, reward = (result[0], result[1]) if isinstance(result, tuple) and len(result) == 3 else (result, None)
        if not isinstance(response, ToolResponse) or not isinstance(response.text, str):
            metrics["tool_errors"] += 1
            return f"Error: {call.name} returned {type(result).__name__}, not (ToolResponse, reward, metrics)", None
        if reward is not None and not isinstance(reward, (int, float)):
            reward = None
        return response.text, reward

    async def _release(self, instances: dict, request_id: str):
        for name, instance in instances.items():
            if isinstance(instance, BaseException):
                continue
            tool = self.tools[name]
            try:
                await asyncio.wait_for(tool.release(instance), tool.timeout_s)
            except Exception as e:  # cleanup must not turn a finished trajectory into a failure
                logger.warning("tool %s: release of %s for %s failed: %s: %s", name, instance, request_id,
                               type(e).__name__, e)
