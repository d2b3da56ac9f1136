"""``actor_rollout_ref.rollout.multi_turn`` and ``.agent``: multi-turn, tool-using rollouts (issue 37).

verl's keys and defaults. With ``multi_turn.enable`` every trajectory runs an agent loop
(hybridflow/agent/): generate, parse tool calls, run the tools, append their responses, generate
again, until no call, a turn limit or the response budget (``data.max_response_length``) ends it.
The loop of a row is named by the data's ``agent_name`` column, else ``agent.default_agent_loop``.
All trajectories of a rollout rank run concurrently on one event loop over its vLLM engine
(workers/rollout/vllm_agent.py); ``rollout.mode`` stays ``sync``: the batch returns whole.

Not implemented (verl keys accepted at their "off" value only, hybridflow/verl_compat.py):
``interaction_config_path`` (simulated users), ``agent.agent_loop_config_path`` and
``agent.custom_async_server``. ``agent.num_workers`` is inert: the loops are coroutines inside
each rollout worker, not worker processes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from hybridflow.config.keys import ARR, OPTIONAL_POSITIVE, POSITIVE, key

TRUNCATE_SIDES = ("left", "middle", "right")
TOOL_CALL_FORMATS = ("hermes",)
AGENT_LOOP_NAMES = ("single_turn_agent", "tool_agent")  # hybridflow/agent/registry.py's (a dotted class path too)


@dataclass
class MultiTurnConfig:
    enable: bool = key(False, "agent loops with tool calls in the rollout (rollout.name=vllm)")
    max_assistant_turns: int | None = key(None, "generations per trajectory; null: until the response budget",
                                          OPTIONAL_POSITIVE)
    max_user_turns: int | None = key(None, "tool-response turns per trajectory; null: until the response budget",
                                     OPTIONAL_POSITIVE)
    max_parallel_calls: int = key(1, "tool calls run at once from one turn (more are dropped)", POSITIVE)
    max_tool_response_length: int = key(256, "a tool's text is cut to this many characters", POSITIVE)
    tool_response_truncate_side: str = key("middle", "which part of a long tool text is cut: left | middle | right",
                                           choices=TRUNCATE_SIDES)
    tool_config_path: str | None = key(None, "verl's tool-config YAML (class_name, config, tool_schema per tool); "
                                             "null: no tools", path=True)
    format: str = key("hermes", "how tool calls are written: hermes (<tool_call>{json}</tool_call>)",
                      choices=TOOL_CALL_FORMATS)


@dataclass
class AgentConfig:
    default_agent_loop: str = key("single_turn_agent", "the loop of rows without an agent_name column: "
                                                       "single_turn_agent | tool_agent | a dotted class path")


def multi_turn_errors(cfg) -> list[str]:
    """What ``rollout.multi_turn`` can run on, one line each (called by config/validate.py)."""
    arr = cfg.actor_rollout_ref
    r, mt = arr.rollout, arr.rollout.multi_turn
    if not mt.enable:
        return []
    key_ = f"{ARR}.rollout.multi_turn.enable=true"
    checks = [
        (r.name != "vllm", f"{key_} runs the agent loops over vLLM's engine: set {ARR}.rollout.name=vllm"),
        (not arr.hybrid_engine, f"{key_} runs on the actor's own generation ranks; {ARR}.hybrid_engine=false (a "
                                "rollout pool of its own) is not supported with it yet: set hybrid_engine=true"),
        (r.tensor_model_parallel_size != 1,
         f"{key_} needs {ARR}.rollout.tensor_model_parallel_size=1 (it is {r.tensor_model_parallel_size}): the "
         "ranks of a TP group would add requests at tool-timing-dependent steps and fall out of step"),
        (cfg.stage_fusion.enable, f"{key_} and stage_fusion.enable=true: the fused rollout streams single-turn "
                                  "samples; set one of the two to false"),
        (r.reallocation.enable, f"{key_} and {ARR}.rollout.reallocation.enable=true: trajectories are not moved "
                                "between ranks; set one of the two to false"),
        (r.speculative.enable, f"{key_} and {ARR}.rollout.speculative.enable=true are not combined yet; set one "
                               "of the two to false"),
    ]
    errors = [message for bad, message in checks if bad]
    errors += agent_loop_name_errors(arr.rollout.agent.default_agent_loop)
    path = mt.tool_config_path
    if path:
        if not os.path.isfile(path):
            errors.append(f"{ARR}.rollout.multi_turn.tool_config_path={path} is not a file: give verl's tool-config "
                          "YAML, or null for no tools")
        else:
            from hybridflow.agent.tools.config import tool_config_errors

            errors += [f"{ARR}.rollout.multi_turn.tool_config_path: {e}" for e in tool_config_errors(path)]
    return errors


def agent_loop_name_errors(name: str) -> list[str]:
    """A registered loop name or a dotted class path that imports."""
    if name in AGENT_LOOP_NAMES:
        return []
    if "." not in name:
        return [f"{ARR}.rollout.agent.default_agent_loop={name!r} is unknown: use one of {AGENT_LOOP_NAMES} or a "
                "dotted class path (pkg.module.Class)"]
    try:
        from hybridflow.agent.registry import resolve_agent_loop

        resolve_agent_loop(name)
    except Exception as err:  # noqa: BLE001 - an import of the user's module may raise anything
        return [f"{ARR}.rollout.agent.default_agent_loop={name!r} does not load ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''})"]
    return []
