"""hybridflow/agent/registry.py and single_turn.py: loops by name or dotted path; the single-turn loop."""
import asyncio

import pytest

from hybridflow.agent.loop import METRIC_KEYS, AgentLoopBase, AgentSettings
from hybridflow.agent.registry import AGENT_LOOPS, resolve_agent_loop
from hybridflow.agent.single_turn import SingleTurnAgentLoop
from hybridflow.agent.tool_agent import ToolAgentLoop
from hybridflow.agent.tools.calculator import CalculatorTool

from .fakes import ScriptedServer, call
from .templates import CUSTOM, char_tokenizer


class MyLoop(AgentLoopBase):
    async def run(self, sampling_params, **row):
        raise NotImplementedError


def test_names_and_dotted_paths_resolve_and_unknown_names_are_one_line_errors():
    assert resolve_agent_loop("tool_agent") is ToolAgentLoop and AGENT_LOOPS["single_turn_agent"] is SingleTurnAgentLoop
    assert resolve_agent_loop(f"{__name__}.MyLoop") is MyLoop
    with pytest.raises(ValueError, match="unknown agent loop 'tools': use one of single_turn_agent, tool_agent"):
        resolve_agent_loop("tools")
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_agent_loop("no_such_pkg.Loop")
    with pytest.raises(ValueError, match="not a subclass"):
        resolve_agent_loop("collections.OrderedDict")


def test_single_turn_generates_once_without_offering_tools_even_when_the_text_calls_one():
    tok = char_tokenizer(CUSTOM)
    text = call("calculator", expression="1+1")
    server = ScriptedServer(tok, [text])
    loop = SingleTurnAgentLoop(server, tok, AgentSettings(response_length=500), {"calculator": CalculatorTool()})
    out = asyncio.run(loop.run({"temperature": 0.0}, raw_prompt=[{"role": "user", "content": "hi"}], request_id="r"))
    assert tok.decode(out.prompt_ids) == "<user>hi</s>\n<assistant>"
    assert out.response_ids == server.calls[0]["ids"] and out.response_mask == [1] * len(out.response_ids)
    assert out.response_logprobs == server.calls[0]["log_probs"] and len(server.calls) == 1
    assert server.calls[0]["params"] == {"temperature": 0.0, "max_tokens": 500}
    assert set(out.metrics) == set(METRIC_KEYS) and out.metrics["generated_tokens"] == len(out.response_ids)
    assert out.num_turns == 2 and out.extra_fields["tool_outputs"] == []
