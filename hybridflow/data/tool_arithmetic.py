"""The tool-use demo task (issue 37): ``a*b+c`` with 3-digit operands, solved with a calculator.

A tiny char-level model cannot multiply 3-digit numbers in its head, but it can learn to copy the
question into a calculator call and the calculator's answer into its reply:

    user:       123*456+789=
    assistant:  <tool_call>{"name":"calc","arguments":{"expression":"123*456+789"}}</tool_call>
    tool:       <tool_response>56877</tool_response>
    assistant:  56877

Files written (``write_tool_arithmetic``):
- ``train.parquet`` / ``val.parquet``: RL rows in verl's schema (``data_source``, ``prompt`` as chat
  messages, ``agent_name: tool_agent`` picks the tool agent loop per row, ``reward_model.ground_truth``,
  ``extra_info``); the agent loop adds the tool schemas (``tools=``) when it templates the prompt.
- ``sft_train.parquet`` / ``sft_val.parquet``: ``messages`` conversations for the multi-turn SFT
  (``data.multiturn``). Their first message is the system text that ``tools=`` renders
  (``hybridflow.tiny_chat.tools_system_text``), so a warm-started model sees at RL time exactly
  the prompt tokens it was trained on. A share ``1 - tool_fraction`` of the traces answer directly,
  without the tool (with the right number, which the model cannot learn): the warm-started policy
  then sometimes guesses, and GRPO has a choice to learn (call the tool) besides copying well.

The tool's name and schema (``TOOL_SCHEMA``) must match the tool config the recipe loads
(``recipes/config/tools/calculator.yaml``); short names keep each call short in characters.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from hybridflow.data.task_files import task_main, write_splits

DATA_SOURCE = "tool_arithmetic"
AGENT_NAME = "tool_agent"
TOOL_NAME = "calc"
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression (integers, + - * / // % ** and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12*34+5"}},
            "required": ["expression"],
        },
    },
}


@dataclasses.dataclass
class ToolArithmeticConfig:
    """``digits``: ``a`` and ``b`` are uniform in ``[10**(digits-1), 10**digits)`` (``c`` too), so
    every product has the same number of digits as the others of its size. ``tool_fraction``: the
    share of SFT traces that call the tool (the rest answer directly)."""

    digits: int = 3
    train_size: int = 2048
    val_size: int = 128
    tool_fraction: float = 0.5
    seed: int = 0

    def validate(self) -> None:
        if not 1 <= self.digits <= 6:
            raise ValueError(f"tool_arithmetic digits={self.digits}: use an integer from 1 to 6")
        if self.train_size < 1 or self.val_size < 0:
            raise ValueError(f"tool_arithmetic train_size={self.train_size}, val_size={self.val_size}: "
                             "train_size must be positive and val_size non-negative")
        if not 0.0 <= self.tool_fraction <= 1.0:
            raise ValueError(f"tool_arithmetic tool_fraction={self.tool_fraction}: use a value in [0, 1]")


def tool_call_text(expression: str) -> str:
    """The assistant turn that calls the calculator (compact Hermes JSON: every character is a token)."""
    call = {"name": TOOL_NAME, "arguments": {"expression": expression}}
    return "<tool_call>" + json.dumps(call, separators=(",", ":")) + "</tool_call>"


def _rl_row(a: int, b: int, c: int, split: str, index: int) -> dict:
    expression, answer = f"{a}*{b}+{c}", str(a * b + c)
    return {
        "data_source": DATA_SOURCE,
        "agent_name": AGENT_NAME,
        "prompt": [{"role": "user", "content": expression + "="}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "question": expression + "=", "answer": answer,
                       "expression": expression},
    }


def sft_messages(row: dict, use_tool: bool) -> list[dict]:
    """One SFT conversation for an RL row: the tools' system text, the question, then either the
    calculator call, its response and the answer, or the answer alone."""
    from hybridflow.tiny_chat import tools_system_text

    answer = row["reward_model"]["ground_truth"]
    head = [{"role": "system", "content": tools_system_text([TOOL_SCHEMA])}, *row["prompt"]]
    if not use_tool:
        return head + [{"role": "assistant", "content": answer}]
    return head + [{"role": "assistant", "content": tool_call_text(row["extra_info"]["expression"])},
                   {"role": "tool", "content": answer},
                   {"role": "assistant", "content": answer}]


def generate_tool_arithmetic(config: ToolArithmeticConfig) -> tuple[list[dict], list[dict]]:
    """Seeded (train_rows, val_rows) of distinct problems; the same config gives the same rows."""
    config.validate()
    rng = np.random.default_rng(config.seed)
    low, high = 10 ** (config.digits - 1), 10 ** config.digits
    n = config.train_size + config.val_size
    if n > (high - low) ** 3 // 2:
        raise ValueError(f"tool_arithmetic: {n} problems is too many for digits={config.digits}: lower the sizes")
    seen: set[tuple[int, int, int]] = set()
    chosen = []
    while len(chosen) < n:
        a, b, c = (int(x) for x in rng.integers(low, high, size=3))
        if (a, b, c) not in seen:
            seen.add((a, b, c))
            chosen.append((a, b, c))
    train = [_rl_row(*p, "train", i) for i, p in enumerate(chosen[:config.train_size])]
    val = [_rl_row(*p, "val", i) for i, p in enumerate(chosen[config.train_size:])]
    return train, val


def write_tool_arithmetic(out_dir: str, config: ToolArithmeticConfig | None = None) -> tuple[str, str]:
    """Write the RL files and the SFT traces under ``out_dir``; returns the RL files' paths. Which
    traces use the tool is drawn with the task's seed (a fixed share of each split)."""
    import pandas as pd

    config = config or ToolArithmeticConfig()
    train, val = generate_tool_arithmetic(config)
    paths = write_splits(out_dir, train, val)
    rng = np.random.default_rng(config.seed + 1)
    for split, rows in (("train", train), ("val", val)):
        n_tool = round(config.tool_fraction * len(rows))
        use = np.zeros(len(rows), dtype=bool)
        use[rng.permutation(len(rows))[:n_tool]] = True
        traces = [sft_messages(r, bool(u)) for r, u in zip(rows, use)]
        pd.DataFrame({"messages": traces}).to_parquet(os.path.join(out_dir, f"sft_{split}.parquet"), index=False)
    return paths


def main(argv: list[str] | None = None) -> None:
    """``python -m hybridflow.data.tool_arithmetic OUT_DIR [--digits 3] [--tool-fraction 0.5] ...``"""
    task_main(ToolArithmeticConfig, write_tool_arithmetic, argv, main.__doc__)


if __name__ == "__main__":
    main()
