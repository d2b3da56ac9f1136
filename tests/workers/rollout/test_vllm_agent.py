"""Multi-turn, tool-using rollouts on the rollout's vLLM engine (workers/rollout/vllm_agent.py),
through VLLMRollout.generate_sequences with rollout.multi_turn on, in one spawned rank.

A random tiny model writes no Hermes tool calls, so in the spawned process the tool agent's parser
is replaced by one that calls a tool after every turn (named by the turn's text: echo, a tool that
hangs past its timeout, or one that raises); everything else is the real loop, tools, chat template
and engine. Checked over 128 prompts x 4 sampled trajectories: the trained ids are exactly the
generated ids plus the chat template's tool-turn ids (each turn's context extends the previous one
by those), tool tokens are masked and carry log-prob 0, the rollout's log-probs of generated tokens
are transformers' on the assembled batch, the hanging tool is cut at its timeout and the raising
tool fails only its call, both counted; greedy trajectories equal driving the same turns one at a
time through ``LLM.generate``.
"""
import asyncio
import os
import time

import pytest
import torch
import yaml

from hybridflow.agent.tools.base import BaseTool, ToolResponse
from hybridflow.protocol import DataProto
from tests.distributed import run_distributed

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PROMPT_LEN, RESPONSE_LEN, PROMPTS, N = 80, 128, 128, 4
TURNS = 3
STOPS = list(range(3, 40))  # extra stop ids (digits, letters): turns of 1 to a few tokens
TIMEOUT_S = 0.3
TOOL_NAMES = ("echo", "echo", "hang", "boom")


class EchoTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(0.01)  # a tool that waits: other trajectories generate meanwhile
        return ToolResponse(f"ok {parameters.get('x', '')}"), None, {}


class HangTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(3600)


class BoomTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("boom")


def _tool_config(path: str) -> str:
    def entry(cls, name):
        return {"class_name": f"{__name__}.{cls.__name__}", "config": {"type": "native", "timeout_s": TIMEOUT_S},
                "tool_schema": {"type": "function", "function": {
                    "name": name, "description": name,
                    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}}
    with open(path, "w") as f:
        yaml.safe_dump({"tools": [entry(EchoTool, "echo"), entry(HangTool, "hang"), entry(BoomTool, "boom")]}, f)
    return path


def _forced_calls(text: str):
    from hybridflow.agent.tool_calls import FunctionCall, ParsedCalls

    name = TOOL_NAMES[sum(map(ord, text)) % len(TOOL_NAMES)]
    return ParsedCalls(content=text, calls=[FunctionCall(name, {"x": text[:6]})], failures=0)


def _prompts(count: int) -> DataProto:
    """Rows as the data layer gives them: left-padded ids (unused by the agent path) and the chat."""
    raw = [[{"role": "user", "content": f"{i}+{2 * i}="}] for i in range(count)]
    ids = torch.ones((count, 8), dtype=torch.long)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": ids.cumsum(1) - 1},
                               {"raw_prompt": raw, "extra_info": [{"i": i} for i in range(count)],
                                "index": list(range(count))})


def _rollout_worker(rank, world, ckpt, tool_config):
    from vllm import SamplingParams

    from hybridflow.agent import tool_agent
    from workers.rollout import vllm_agent
    from workers.rollout.base import RolloutConfig
    from workers.rollout.vllm_rollout import VLLMRollout

    tool_agent.parse_tool_calls = _forced_calls
    calls = []  # (request id, context ids, generated ids) of every server call
    generate = vllm_agent.EngineTokenServer.generate

    async def recorded(self, request_id, prompt_ids, sampling_params):
        out = await generate(self, request_id, prompt_ids, sampling_params)
        calls.append((request_id, list(prompt_ids), list(out.token_ids)))
        return out

    vllm_agent.EngineTokenServer.generate = recorded
    multi_turn = dict(enable=True, max_assistant_turns=TURNS, max_parallel_calls=1, max_tool_response_length=48,
                      tool_response_truncate_side="middle", tool_config_path=tool_config, format="hermes",
                      default_agent_loop="tool_agent", tokenizer_path=ckpt, apply_chat_template_kwargs={})
    config = RolloutConfig(prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN, kv_cache_gib=0.25, seed=0,
                           n=N, stop_token_ids=STOPS, multi_turn=multi_turn)
    rollout = VLLMRollout(config, ckpt)
    start = time.perf_counter()
    sampled = rollout.generate_sequences(_prompts(PROMPTS))
    sampled_s = time.perf_counter() - start
    sampled_metrics = dict(sampled.meta_info["metrics"])
    sampled_calls, calls[:] = list(calls), []
    greedy_prompts = _prompts(16)
    greedy_prompts.meta_info = {"do_sample": False}
    greedy = rollout.generate_sequences(greedy_prompts)
    greedy_calls = list(calls)
    # the same turns one at a time through LLM.generate (greedy, the rollout's stop ids)
    replayed = []
    for request_id, context, _ in greedy_calls:
        budget = RESPONSE_LEN - (len(context) - _prompt_len(greedy_calls, request_id))
        params = SamplingParams(temperature=0.0, max_tokens=budget, stop_token_ids=rollout.eos_token_ids + STOPS,
                                logprobs=0, detokenize=False)
        [out] = rollout.llm.generate([{"prompt_token_ids": context}], params, use_tqdm=False)
        replayed.append(list(out.outputs[0].token_ids))
    pack = lambda d: ({k: v.numpy() for k, v in d.batch.items()}, {k: list(v) for k, v in d.non_tensor_batch.items()},
                      d.meta_info.get("metrics", {}))
    return dict(sampled=pack(sampled), sampled_metrics=sampled_metrics, sampled_calls=sampled_calls, sampled_s=sampled_s, greedy=pack(greedy),
                greedy_calls=greedy_calls, replayed=replayed, eos=rollout.eos_token_ids)


def _prompt_len(calls, request_id) -> int:
    """The prompt length of ``request_id``'s trajectory: its first turn's context."""
    trajectory = request_id.rsplit("-", 1)[0]
    return min(len(c) for r, c, _ in calls if r.rsplit("-", 1)[0] == trajectory)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from hybridflow.tiny_chat import make_tiny_chat_checkpoint

    root = tmp_path_factory.mktemp("agent")
    ckpt = make_tiny_chat_checkpoint(str(root / "model"), seed=0)
    return ckpt, run_distributed(_rollout_worker, 1, ckpt, _tool_config(str(root / "tools.yaml")), timeout_s=240)[0]


def _trajectories(calls):
    """Per trajectory index: its turns' (context, generated ids) in order."""
    out = {}
    for request_id, context, generated in calls:
        trajectory, turn = request_id.rsplit("-", 1)
        out.setdefault(int(trajectory.removeprefix("traj-")), []).append((int(turn), context, generated))
    return {i: [(c, g) for _, c, g in sorted(turns)] for i, turns in out.items()}


def test_trained_ids_are_the_generated_ids_plus_the_tool_turn_ids(run):
    from hybridflow.agent.chat import ToolTurnTemplate
    from hybridflow.tiny import load_tokenizer

    ckpt, result = run
    tok = load_tokenizer(ckpt)
    tensors, columns, _ = result["sampled"]
    trajectories = _trajectories(result["sampled_calls"])
    rows = PROMPTS * N
    assert len(tensors["responses"]) == rows == len(trajectories) >= 512
    schemas = [{"type": "function", "function": {"name": n, "description": n, "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}} for n in ("echo", "hang", "boom")]
    template = ToolTurnTemplate(tok, schemas)
    tool_turns = 0
    for r in range(rows):
        turns, outputs = trajectories[r], columns["tool_outputs"][r]
        prompt = turns[0][0]
        expected, mask = [], []
        for k, (context, generated) in enumerate(turns):
            assert context == prompt + expected  # each turn continues the ids so far: nothing re-encoded
            expected += generated
            mask += [1] * len(generated)
            if k < len(outputs):  # the tool turn that followed it
                tool_ids = template.ids([outputs[k]], generated[-1])[: RESPONSE_LEN - len(expected)]
                expected += tool_ids
                mask += [0] * len(tool_ids)
                tool_turns += 1
        real = tensors["attention_mask"][r, PROMPT_LEN:].astype(bool)
        assert tensors["responses"][r][real].tolist() == expected
        assert tensors["response_mask"][r][real].tolist() == mask
        assert not tensors["response_mask"][r][~real].any()
        prompt_real = tensors["attention_mask"][r, :PROMPT_LEN].astype(bool)
        assert tensors["prompts"][r][prompt_real].tolist() == prompt
        assert tensors["input_ids"][r].tolist() == tensors["prompts"][r].tolist() + tensors["responses"][r].tolist()
        assert (tensors["rollout_log_probs"][r][tensors["response_mask"][r] == 0] == 0).all()
        assert tensors["agent_tool_tokens"][r] == mask.count(0) and tensors["agent_generated_tokens"][r] == mask.count(1)
    assert tool_turns >= rows  # most trajectories called tools, several times


def test_hanging_and_raising_tools_are_cut_and_counted_without_stopping_the_batch(run):
    _, result = run
    tensors, columns, _ = result["sampled"]
    outputs = columns["tool_outputs"]
    timeouts = [sum("timed out" in t for t in o) for o in outputs]
    errors = [sum("failed: RuntimeError: boom" in t for t in o) for o in outputs]
    assert tensors["agent_tool_timeouts"].tolist() == timeouts and sum(timeouts) > 10
    assert tensors["agent_tool_errors"].tolist() == errors and sum(errors) > 10
    assert result["sampled_s"] < 60  # an hour-long tool, cut at 0.3 s, held nobody up
    assert result["sampled_metrics"]["perf/agent_requests"] == len(result["sampled_calls"])


def test_rollout_log_probs_of_generated_tokens_are_the_models(run):
    from tests.workers.rollout.common import load_hf

    ckpt, result = run
    tensors, _, _ = result["sampled"]
    b = {k: torch.from_numpy(tensors[k][:128]) for k in ("input_ids", "attention_mask", "position_ids",
                                                         "responses", "response_mask", "rollout_log_probs")}
    with torch.no_grad():
        logits = load_hf(ckpt)(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                               position_ids=b["position_ids"]).logits
    lp = torch.log_softmax(logits[:, PROMPT_LEN - 1:-1].float(), -1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    mask = b["response_mask"].bool()
    assert mask.sum() > 500
    torch.testing.assert_close(b["rollout_log_probs"][mask], lp[mask], atol=1e-4, rtol=0)


def test_greedy_trajectories_equal_their_turns_generated_one_at_a_time(run):
    _, result = run
    generated = [g for _, _, g in result["greedy_calls"]]
    assert len(generated) >= 16 * 2
    assert generated == result["replayed"]


def test_a_templated_prompt_past_the_context_fails_naming_the_key_before_reaching_vllm():
    from types import SimpleNamespace

    from workers.rollout.vllm_agent import EngineTokenServer

    server = EngineTokenServer(SimpleNamespace(llm_engine=None), [2], False, context_length=PROMPT_LEN + RESPONSE_LEN)
    with pytest.raises(ValueError, match="raise data.max_prompt_length"):
        asyncio.run(server.generate("traj-0-0", [5] * (PROMPT_LEN + 1), {"max_tokens": RESPONSE_LEN}))
