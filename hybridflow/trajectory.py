"""What a multi-turn batch (workers/rollout/vllm_agent.py) carries beyond the single-turn one, and
how the trainer reads it (issue 37).

In a multi-turn batch the response holds the generated ids and the tool-response ids in order:
``response_mask`` is 1 on generated ids only (losses, KL, advantages, entropy and the
rollout/trainer log-prob comparison use it), ``attention_mask`` is 1 on every real token. So
what the reward reads, the whole trajectory, is the response under ``attention_mask``
(:func:`response_token_mask`); a single-turn batch reads ``response_mask`` as before.
"""
from __future__ import annotations

import torch

# per-row float columns of a multi-turn batch -> the agent loop's metric name (AgentLoopOutput.metrics)
AGENT_COLUMNS = {
    "agent_num_turns": "num_turns",
    "agent_tool_calls": "tool_calls",
    "agent_tool_errors": "tool_errors",
    "agent_tool_timeouts": "tool_timeouts",
    "agent_parse_failures": "parse_failures",
    "agent_generated_tokens": "generated_tokens",
    "agent_tool_tokens": "tool_tokens",
}
MULTI_TURN_MARK = "agent_num_turns"  # a batch with this column is multi-turn
TOOL_OUTPUTS = "tool_outputs"  # non-tensor column: per row, the tool texts that went into the conversation


def is_multi_turn(tensors) -> bool:
    return MULTI_TURN_MARK in tensors.keys()


def response_token_mask(tensors) -> torch.Tensor:
    """[B, R] 1 on the response tokens the reward reads: every real token of a multi-turn
    trajectory (tool responses included), else ``response_mask``."""
    if is_multi_turn(tensors) and "attention_mask" in tensors.keys():
        return tensors["attention_mask"][:, -tensors["responses"].shape[1]:]
    return tensors["response_mask"]


def last_generated_index(response_mask: torch.Tensor) -> torch.Tensor:
    """[B] the position of each row's last token with ``response_mask`` 1 (0 for a row with none):
    where an outcome reward must sit, since advantages ignore masked positions."""
    columns = torch.arange(response_mask.shape[1], device=response_mask.device)
    return (columns * response_mask.bool()).amax(-1)


def scores_on_last_generated(token_level_scores: torch.Tensor, tensors) -> torch.Tensor:
    """A multi-turn batch's token-level scores moved, row by row, onto the last generated token: a
    trajectory cut inside a tool response ends on a tool token, whose reward GRPO's masked sum and
    GAE would drop. Single-turn scores are returned as they are."""
    if not is_multi_turn(tensors):
        return token_level_scores
    moved = torch.zeros_like(token_level_scores)
    moved[torch.arange(len(moved)), last_generated_index(tensors["response_mask"])] = token_level_scores.sum(-1)
    return moved


def reward_columns(tensors) -> list[str]:
    """The tensor columns a reward computation needs (the reward process gets a snapshot of them)."""
    wanted = ["responses", "response_mask"] + (["attention_mask", MULTI_TURN_MARK] if is_multi_turn(tensors) else [])
    return [k for k in wanted if k in tensors.keys()]


def extra_infos_with_tool_outputs(extra_infos, tool_outputs) -> list:
    """Each row's ``extra_info`` (a fresh dict: the n samples of a prompt share one) with its tool
    texts under ``"tool_outputs"``; rows as they are when there is no such column."""
    if tool_outputs is None:
        return list(extra_infos)
    return [{**(info or {}), TOOL_OUTPUTS: list(outputs)} for info, outputs in zip(extra_infos, tool_outputs)]


def agent_step_metrics(tensors) -> dict[str, float]:
    """verl-like ``agent/*`` metrics of a step's trajectories: means per trajectory for turns, calls
    and tokens; totals for what went wrong (tool errors, timeouts, unparsable calls)."""
    if not is_multi_turn(tensors):
        return {}
    out = {}
    for column, name in AGENT_COLUMNS.items():
        values = tensors[column].float()
        if name in ("tool_errors", "tool_timeouts", "parse_failures"):
            out[f"agent/{name}"] = float(values.sum())
        else:
            out[f"agent/{name}/mean"] = float(values.mean())
            if name in ("num_turns", "tool_calls"):
                out[f"agent/{name}/max"] = float(values.max())
    return out

