"""Rule reward of the tool-use demo task (hybridflow/data/tool_arithmetic.py): is the final answer right?

The reward sees the whole trajectory decoded (assistant turns, tool calls and tool responses alike,
``<|im_start|>``/``<|im_end|>`` usually dropped as special tokens), e.g.

    <tool_call>{"name":"calc",...}</tool_call>tool\\n<tool_response>56877</tool_response>assistant\\n56877

The last assistant turn is what follows the last ``</tool_response>`` (the whole text when no tool
answered), less its role header. Score 1.0 when that turn holds no tool call and its last integer
equals the ground truth, else 0.0: a trajectory cut before it answered, or whose last turn is
another call, has no answer; the number a tool returned counts only once the model repeats it.
"""
from __future__ import annotations

import re

from hybridflow.rewards.arithmetic import parse_ground_truth

_INT = re.compile(r"-?\d+")
_HEADER = re.compile(r"^\s*(<\|im_start\|>)?assistant\n")


def last_assistant_turn(solution_str: str) -> str:
    """The text of the trajectory's last assistant turn by the rule above."""
    turn = solution_str.rsplit("</tool_response>", 1)[-1]
    turn = turn.split("<|im_end|>", 1)[1] if turn.startswith("<|im_end|>") else turn
    return _HEADER.sub("", turn, count=1).replace("<|im_end|>", "")


def extract_answer(solution_str: str) -> int | None:
    """The final answer (the last integer of the last assistant turn), None when it has none or calls a tool."""
    turn = last_assistant_turn(solution_str)
    if "<tool_call>" in turn:
        return None
    numbers = _INT.findall(turn)
    return int(numbers[-1]) if numbers else None


def compute_score(solution_str: str, ground_truth: object) -> float:
    truth = parse_ground_truth(ground_truth)  # first: a bad ground truth raises on every sample
    answer = extract_answer(solution_str)
    return 1.0 if answer is not None and answer == truth else 0.0
