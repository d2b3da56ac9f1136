"""hybridflow/agent/tool_agent.py: tokens in, tokens out; tool tokens masked; tools that raise,
hang or return garbage become error texts and metrics; parallel calls, turn limits and the budget."""
import asyncio
import random

import pytest

from hybridflow.agent.chat import render
from hybridflow.agent.loop import METRIC_KEYS, AgentSettings
from hybridflow.agent.tool_agent import ToolAgentLoop
from hybridflow.agent.tools.calculator import CalculatorTool

from hybridflow.agent.tools.base import ToolResponse

from .fakes import GarbageTool, HangingTool, RaisingTool, RecordingTool, ScriptedServer, call
from .templates import CUSTOM, char_tokenizer, qwen_style_char_tokenizer

PROMPT = [{"role": "user", "content": "What is 2+3*4?"}]


def run(loop, request_id="r", prompt=PROMPT, **row):
    return asyncio.run(loop.run({"temperature": 1.0, "top_p": 1.0}, raw_prompt=prompt, request_id=request_id, **row))


def check_tokens_in_tokens_out(out, server_calls, prefix=None):
    """response = generated ids (mask 1, server log-probs) and tool ids (mask 0, log-prob 0) in order, and
    every server call saw exactly the prompt plus the response so far."""
    assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs)
    at = 0
    for c in server_calls:
        assert c["prompt_ids"] == out.prompt_ids + out.response_ids[:at]
        n = len(c["ids"])
        assert out.response_ids[at:at + n] == c["ids"]
        assert out.response_mask[at:at + n] == [1] * n and out.response_logprobs[at:at + n] == c["log_probs"]
        at += n
        while at < len(out.response_ids) and out.response_mask[at] == 0:  # the tool turn that follows
            assert out.response_logprobs[at] == 0.0
            at += 1
    assert at == len(out.response_ids)


@pytest.mark.parametrize("make_tok", [lambda: char_tokenizer(CUSTOM), qwen_style_char_tokenizer])
def test_a_calculator_trajectory_is_generated_plus_tool_ids_and_reads_as_the_conversation(make_tok):
    tok = make_tok()
    turns = [call("calculator", expression="3*4"), "12. " + call("calculator", expression="2+12"), "It is 14."]
    server = ScriptedServer(tok, turns)
    loop = ToolAgentLoop(server, tok, AgentSettings(response_length=1000), {"calculator": CalculatorTool()})
    out = run(loop)
    check_tokens_in_tokens_out(out, server.calls)
    assert [c["params"]["max_tokens"] for c in server.calls] == [1000 - (len(c["prompt_ids"]) - len(out.prompt_ids))
                                                                  for c in server.calls]
    assert all(c["params"]["temperature"] == 1.0 for c in server.calls)
    conversation = PROMPT + [{"role": "assistant", "content": turns[0]}, {"role": "tool", "content": "12"},
                             {"role": "assistant", "content": turns[1]}, {"role": "tool", "content": "14"},
                             {"role": "assistant", "content": turns[2]}]
    whole = render(tok, conversation, [CalculatorTool().tool_schema], False)
    assert whole.startswith(tok.decode(out.prompt_ids + out.response_ids, skip_special_tokens=False))
    assert out.response_ids[-1] == tok.eos_token_id  # the last turn keeps its stop token
    assert out.extra_fields["tool_outputs"] == ["12", "14"] and out.extra_fields["stop_reason"] == "no_tool_call"
    assert out.num_turns == 6
    assert set(out.metrics) == set(METRIC_KEYS)
    assert out.metrics["tool_calls"] == 2 and out.metrics["generated_tokens"] == sum(len(c["ids"]) for c in server.calls)
    assert out.metrics["tool_tokens"] == out.response_mask.count(0) > 0


def test_512_concurrent_random_trajectories_are_exactly_generated_plus_tool_ids():
    """Issue 37's acceptance on the loop: over 512 trajectories (random turns, calls, bad calls and
    budgets, interleaved on one event loop) the ids are the generated ids plus the tool ids, 100%."""
    tok = char_tokenizer(CUSTOM)
    rng = random.Random(0)
    scripts = {}
    for i in range(512):
        turns = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            if kind < 0.5:
                turns.append(call("calculator", expression=f"{rng.randint(0, 99)}*{rng.randint(0, 9)}"))
            elif kind < 0.6:
                turns.append("<tool_call>{broken</tool_call>")
            elif kind < 0.7:
                turns.append(call("echo", a=rng.randint(0, 9)) + call("calculator", expression="1/0"))
            else:
                turns.append(call("calculator", expression="x"))
        scripts[f"t{i}"] = turns + ["done"]
    server = ScriptedServer(tok, scripts)
    tools = {"calculator": CalculatorTool(), "echo": RecordingTool()}

    async def main():
        loops = [ToolAgentLoop(server, tok, AgentSettings(response_length=rng.choice([60, 150, 400]),
                                                          max_parallel_calls=2), tools) for _ in scripts]
        return await asyncio.gather(*(lp.run({}, raw_prompt=PROMPT, request_id=rid) for lp, rid in zip(loops, scripts)))

    outs = asyncio.run(main())
    for rid, out in zip(scripts, outs):
        check_tokens_in_tokens_out(out, [c for c in server.calls if c["request_id"].rsplit("-", 1)[0] == rid])
    stops = {o.extra_fields["stop_reason"] for o in outs}
    assert {"budget", "no_tool_call"} <= stops
    assert sum(o.metrics["parse_failures"] for o in outs) > 0 and sum(o.metrics["tool_calls"] for o in outs) > 0


def test_raising_hanging_garbage_and_unknown_tools_become_error_texts_and_metrics():
    tok = char_tokenizer(CUSTOM)
    tools = {t.name: t for t in (RaisingTool(), HangingTool(timeout_s=0.05), GarbageTool("junk", "just text"),
                                 GarbageTool("junk2", ToolResponse(text=5)))}
    turns = [call("boom") + call("hang") + call("junk") + call("junk2") + call("nope"), "sorry"]
    server = ScriptedServer(tok, turns)
    settings = AgentSettings(response_length=2000, max_parallel_calls=5)
    out = run(ToolAgentLoop(server, tok, settings, tools))
    texts = out.extra_fields["tool_outputs"]
    assert texts[0] == "Error: boom failed: RuntimeError: disk on fire"
    assert texts[1] == "Error: hang timed out after 0.05 s"
    assert texts[2].startswith("Error: junk returned str") and texts[3].startswith("Error: junk2 returned ToolResponse")
    assert texts[4] == "Error: no tool named 'nope'; available: boom, hang, junk, junk2"
    assert out.metrics["tool_errors"] == 4 and out.metrics["tool_timeouts"] == 1 and out.metrics["tool_calls"] == 5
    assert len(server.calls) == 2  # the trajectory went on after the failures
    decoded = tok.decode(out.response_ids, skip_special_tokens=False)
    assert "<tool>Error: hang timed out after 0.05 s</s>" in decoded


def test_calls_beyond_max_parallel_calls_are_dropped_and_the_rest_run_concurrently():
    tok = char_tokenizer(CUSTOM)
    echo = RecordingTool(delay=0.05)
    server = ScriptedServer(tok, [call("echo", a=1) + call("echo", a=2) + call("echo", a=3), "ok"])
    out = run(ToolAgentLoop(server, tok, AgentSettings(response_length=2000, max_parallel_calls=2), {"echo": echo}))
    assert out.metrics["tool_calls"] == 2 and echo.peak == 2
    assert out.extra_fields["tool_outputs"] == ["inst0:[('a', 1)]", "inst0:[('a', 2)]"]
    assert out.extra_fields["tool_rewards"] == [0.5, 0.5]


def test_one_instance_per_tool_per_trajectory_created_with_row_kwargs_and_always_released():
    tok = char_tokenizer(CUSTOM)
    echo = RecordingTool()
    server = ScriptedServer(tok, [call("echo", a=1), call("echo", a=2), "done"])
    extra = {"tools_kwargs": {"echo": {"create_kwargs": {"ground_truth": "14"}}}}
    run(ToolAgentLoop(server, tok, AgentSettings(response_length=2000), {"echo": echo}), extra_info=extra)
    assert echo.created == [("inst0", {"ground_truth": "14"})] and echo.released == ["inst0"]

    class Failing(ScriptedServer):
        async def generate(self, request_id, prompt_ids, sampling_params):
            if request_id.endswith("-1"):
                raise ConnectionError("engine died")
            return await super().generate(request_id, prompt_ids, sampling_params)

    echo2 = RecordingTool()
    with pytest.raises(ConnectionError):
        run(ToolAgentLoop(Failing(tok, [call("echo", a=1), "x"]), tok, AgentSettings(response_length=2000), {"echo": echo2}))
    assert echo2.released == ["inst0"]


def test_a_hanging_tool_is_cut_at_its_timeout():
    tok = char_tokenizer(CUSTOM)
    server = ScriptedServer(tok, [call("hang"), "ok"])
    loop = ToolAgentLoop(server, tok, AgentSettings(response_length=2000), {"hang": HangingTool(timeout_s=0.1)})

    async def timed():
        t0 = asyncio.get_running_loop().time()
        out = await loop.run({}, raw_prompt=PROMPT, request_id="r")
        return out, asyncio.get_running_loop().time() - t0

    out, seconds = asyncio.run(timed())
    assert out.metrics["tool_timeouts"] == 1 and seconds < 5  # the tool sleeps 60 s


def test_turn_limits_stop_without_running_the_last_calls():
    tok = char_tokenizer(CUSTOM)
    echo = RecordingTool()
    turns = [call("echo", a=i) for i in range(10)]
    out = run(ToolAgentLoop(ScriptedServer(tok, turns), tok, AgentSettings(response_length=5000, max_assistant_turns=3),
                            {"echo": echo}))
    assert out.metrics["tool_calls"] == 2 and out.num_turns == 1 + 3 + 2
    assert out.extra_fields["stop_reason"] == "max_assistant_turns" and out.response_mask[-1] == 1
    out = run(ToolAgentLoop(ScriptedServer(tok, turns), tok, AgentSettings(response_length=5000, max_user_turns=2),
                            {"echo": echo}))
    assert out.metrics["tool_calls"] == 2 and out.extra_fields["stop_reason"] == "max_user_turns"


@pytest.mark.parametrize("budget, cut_in", [(30, 1), (95, 0), (120, 1)])  # 1: in a generation, 0: in a tool turn
def test_the_response_is_cut_at_response_length(budget, cut_in):
    """A generation that reaches the budget ends the trajectory; a tool turn that does not fit is cut."""
    tok = char_tokenizer(CUSTOM)
    turns = [call("calculator", expression="2+3"), call("calculator", expression="5*5"), "twenty-five"]
    server = ScriptedServer(tok, turns)
    out = run(ToolAgentLoop(server, tok, AgentSettings(response_length=budget), {"calculator": CalculatorTool()}))
    assert len(out.response_ids) <= budget
    check_tokens_in_tokens_out(out, server.calls)
    assert out.extra_fields["stop_reason"] == "budget" and len(out.response_ids) == budget
    assert out.response_mask[-1] == cut_in
    assert all(c["params"]["max_tokens"] == budget - (len(c["prompt_ids"]) - len(out.prompt_ids)) for c in server.calls)


def test_long_tool_text_is_truncated_to_max_tool_response_length():
    tok = char_tokenizer(CUSTOM)
    server = ScriptedServer(tok, [call("calculator", expression="10**60"), "big"])
    settings = AgentSettings(response_length=2000, max_tool_response_length=10, tool_response_truncate_side="left")
    out = run(ToolAgentLoop(server, tok, settings, {"calculator": CalculatorTool()}))
    assert out.extra_fields["tool_outputs"] == ["1000000000...(truncated)"]


def test_a_plain_string_prompt_is_one_user_message_and_an_unknown_format_is_refused():
    tok = char_tokenizer(CUSTOM)
    server = ScriptedServer(tok, ["hi"])
    out = run(ToolAgentLoop(server, tok, AgentSettings(), {}), prompt="hello")
    assert tok.decode(out.prompt_ids) == "<user>hello</s>\n<assistant>"
    with pytest.raises(ValueError, match="format='json'"):
        ToolAgentLoop(server, tok, AgentSettings(format="json"), {})
