"""The tool-use recipe (`--config-name grpo_tools`, issue 37) end to end on 2 CPU slots: trajectories
call the calculator, the agent metrics are logged, and the tool tokens are out of the loss.

The policy must call the tool for any of this to show, and a random model never writes a
``<tool_call>``: the fixture fits the tiny chat model to a dozen tool traces in-process (a few
seconds of plain PyTorch), so that it calls the calculator when sampled.
"""
from __future__ import annotations

import json
import math
import os

import pytest

from tests.recipes.conftest import run_main_ppo

pytestmark = pytest.mark.slow


def fit_tool_traces(model_path: str, trace_file: str, steps: int = 150) -> None:
    """Overfit the model to the traces' assistant turns (the SFT recipe's loss, without its workers)."""
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.data.multiturn import encode_conversation
    from hybridflow.tiny import load_tokenizer

    tok = load_tokenizer(model_path)
    seqs = []
    for i, messages in enumerate(pd.read_parquet(trace_file)["messages"]):
        prompt, response, mask = encode_conversation(tok, list(messages), f"row {i}")
        seqs.append((prompt + response, [-100] * len(prompt) + [t if m else -100 for t, m in zip(response, mask)]))
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s, _ in seqs])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in seqs])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=(labels != -100) | (ids != tok.pad_token_id), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5, f"the tool traces were not fitted (loss {loss.item():.3f})"
    model.save_pretrained(model_path, safe_serialization=True)


@pytest.fixture(scope="module")
def tool_assets(tmp_path_factory):
    from hybridflow.data.tool_arithmetic import ToolArithmeticConfig, write_tool_arithmetic
    from hybridflow.tiny_chat import make_tiny_chat_checkpoint

    root = tmp_path_factory.mktemp("tool_assets")
    # 1-digit operands: short calls (the whole trajectory ~80 tokens); every trace calls the tool
    train, val = write_tool_arithmetic(str(root / "data"), ToolArithmeticConfig(
        digits=1, train_size=12, val_size=4, tool_fraction=1.0))
    model = make_tiny_chat_checkpoint(str(root / "model"), "llama", hidden=64, layers=2, heads=2, kv_heads=1,
                                      intermediate=128)
    fit_tool_traces(model, str(root / "data" / "sft_train.parquet"))
    return model, train, val


def test_grpo_tools_trains_on_tool_trajectories_with_tool_tokens_masked(tool_assets, tmp_path):
    model, train, val = tool_assets
    out = str(tmp_path / "run")
    result = run_main_ppo("grpo_tools", [
        f"data.train_files=[{train}]", f"data.val_files=[{val}]", f"actor_rollout_ref.model.path={model}",
        "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        # a small step: the fitted policy must still call the tool at step 2 (the recipe's 1e-3
        # unsettles a model fitted to a dozen traces in one step)
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.logger=[console,jsonl]",
        "trainer.n_gpus_per_node=2", f"trainer.default_local_dir={out}"], timeout=300)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-6000:]}"
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = {row["step"]: row for row in map(json.loads, f)}
    assert math.isfinite(rows[0]["val/score/mean"]) and math.isfinite(rows[2]["val/score/mean"])
    for step in (1, 2):
        row = rows[step]
        for key in ("agent/num_turns/mean", "agent/tool_calls/mean", "agent/generated_tokens/mean",
                    "agent/tool_tokens/mean", "agent/tool_errors", "agent/parse_failures", "actor/pg_loss"):
            assert key in row and math.isfinite(row[key]), f"step {step}: {key} missing or not finite"
        # the fitted policy calls the calculator: tool responses are in its trajectories
        assert row["agent/tool_calls/mean"] > 0.25 and row["agent/tool_tokens/mean"] > 0, row
        assert row["agent/num_turns/mean"] > 1.5, row
        # response_length counts the whole trajectory; the loss's mask only the generated part
        assert row["response_length/mean"] == pytest.approx(
            row["agent/generated_tokens/mean"] + row["agent/tool_tokens/mean"], rel=1e-4)
        # tool tokens carry no sampler log-prob (0.0): had they been in response_mask, the
        # sampler/trainer probability comparison over it would be off by ~1 on each of them
        assert row["training/rollout_probs_diff_max"] < 0.05, row["training/rollout_probs_diff_max"]
