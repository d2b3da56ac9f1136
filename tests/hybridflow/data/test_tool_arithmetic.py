"""The tool demo task: RL rows in verl's schema with the tool agent loop, SFT traces whose prompt tokens
equal what the agent loop renders, and the same tool schema as the recipe's tool config."""
import pandas as pd
import pytest
import yaml

from hybridflow.data.sft_dataset import SFTDataset
from hybridflow.data.tool_arithmetic import (TOOL_SCHEMA, ToolArithmeticConfig, generate_tool_arithmetic,
                                             write_tool_arithmetic)
from hybridflow.tiny_chat import make_chat_tokenizer


def test_rows_are_seeded_distinct_and_answer_the_expression():
    cfg = ToolArithmeticConfig(train_size=300, val_size=50, seed=3)
    train, val = generate_tool_arithmetic(cfg)
    assert (train, val) == generate_tool_arithmetic(cfg)
    questions = [r["prompt"][0]["content"] for r in train + val]
    assert len(set(questions)) == 350
    for row in train[:20]:
        a, rest = row["extra_info"]["expression"].split("*")
        b, c = rest.split("+")
        assert all(100 <= int(x) <= 999 for x in (a, b, c))
        assert row["reward_model"]["ground_truth"] == str(int(a) * int(b) + int(c))
        assert row["agent_name"] == "tool_agent" and row["data_source"] == "tool_arithmetic"


@pytest.mark.parametrize("bad", [dict(digits=0), dict(tool_fraction=1.5), dict(train_size=0)])
def test_bad_config_names_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        generate_tool_arithmetic(ToolArithmeticConfig(**bad))


def test_sft_traces_train_the_call_and_the_answer_on_the_agent_loops_prompt(tmp_path):
    write_tool_arithmetic(str(tmp_path), ToolArithmeticConfig(train_size=40, val_size=4, tool_fraction=0.25))
    traces = pd.read_parquet(tmp_path / "sft_train.parquet")["messages"]
    rl = pd.read_parquet(tmp_path / "train.parquet")
    assert sum(len(m) == 5 for m in traces) == 10 and sum(len(m) == 3 for m in traces) == 30
    tok = make_chat_tokenizer()
    data = SFTDataset([str(tmp_path / "sft_train.parquet")], tok, messages_key="messages", max_length=160)
    for (prompt, response, mask), messages, row in zip(data.rows, traces, rl.itertuples()):
        # the agent loop's prompt: the row's messages with tools=, generation prompt on
        expected = tok.apply_chat_template(list(row.prompt), tools=[TOOL_SCHEMA], add_generation_prompt=True,
                                           tokenize=True)
        assert prompt == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        answer = row.reward_model["ground_truth"]
        trained = tok.decode([t for t, m in zip(response, mask) if m])
        if len(messages) == 5:
            assert trained.startswith('<tool_call>{"name":"calc","arguments":{"expression":"')
            assert trained.endswith(f"</tool_call><|im_end|>{answer}<|im_end|>")
            assert tok.decode([t for t, m in zip(response, mask) if not m]) == \
                f"<|im_start|>tool\n<tool_response>{answer}</tool_response><|im_end|><|im_start|>assistant\n"
        else:
            assert trained == f"{answer}<|im_end|>"


def test_tool_schema_is_the_recipes_tool_config():
    with open("recipes/config/tools/calculator.yaml") as f:
        tools = yaml.safe_load(f)["tools"]
    assert [t["tool_schema"] for t in tools] == [TOOL_SCHEMA]


def test_the_tool_agent_loop_replays_an_sft_trace_token_for_token(tmp_path):
    """A policy that writes what the SFT traces taught gets, from the tool agent loop with the real
    calculator, exactly the traced conversation's tokens: warm start and RL see the same sequences,
    and the reward reads the right answer from the trajectory."""
    import asyncio

    from hybridflow.agent.loop import AgentSettings, TokenOutput
    from hybridflow.agent.tool_agent import ToolAgentLoop
    from hybridflow.agent.tools.config import load_tools
    from hybridflow.data.multiturn import encode_conversation
    from hybridflow.rewards.registry import default_compute_score

    write_tool_arithmetic(str(tmp_path), ToolArithmeticConfig(train_size=4, val_size=1, tool_fraction=1.0))
    tok = make_chat_tokenizer()
    rl = pd.read_parquet(tmp_path / "train.parquet")
    traces = pd.read_parquet(tmp_path / "sft_train.parquet")["messages"]
    for i, (row, messages) in enumerate(zip(rl.itertuples(), traces)):
        prompt, response, mask = encode_conversation(tok, list(messages), "trace")
        turns, turn = [], []  # the assistant turns' tokens, each ending at <|im_end|>
        for t, m in zip(response, mask):
            if m:
                turn.append(t)
                if t == tok.eos_token_id:
                    turns.append(turn)
                    turn = []

        class Replay:
            async def generate(self, request_id, prompt_ids, sampling_params):
                out = turns.pop(0)
                return TokenOutput(out, [0.0] * len(out))

        loop = ToolAgentLoop(Replay(), tok, AgentSettings(response_length=128),
                             load_tools("recipes/config/tools/calculator.yaml"))
        out = asyncio.run(loop.run({"temperature": 1.0}, raw_prompt=list(row.prompt), extra_info=row.extra_info,
                                   request_id=f"r{i}"))
        assert out.prompt_ids == prompt and out.response_ids == response and out.response_mask == mask
        text = tok.decode(out.response_ids, skip_special_tokens=True)
        assert default_compute_score("tool_arithmetic", text, row.reward_model["ground_truth"]) == 1.0
