"""Agent loops by name: the ``agent_name`` column of a row (or
``actor_rollout_ref.rollout.agent.default_agent_loop``) picks one; a dotted path names a user's class."""
from __future__ import annotations

from hybridflow.agent.loop import AgentLoopBase
from hybridflow.agent.single_turn import SingleTurnAgentLoop
from hybridflow.agent.tool_agent import ToolAgentLoop

AGENT_LOOPS: dict[str, type[AgentLoopBase]] = {
    "single_turn_agent": SingleTurnAgentLoop,
    "tool_agent": ToolAgentLoop,
}


def resolve_agent_loop(name: str) -> type[AgentLoopBase]:
    """The loop class for a registered name or a dotted path 'package.module.Class'."""
    if name in AGENT_LOOPS:
        return AGENT_LOOPS[name]
    if isinstance(name, str) and "." in name:
        import importlib

        module, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except Exception as e:
            raise ValueError(f"agent loop {name!r} cannot be imported ({type(e).__name__}: {e}): give a registered "
                             f"name ({', '.join(AGENT_LOOPS)}) or an importable 'package.module.Class'") from None
        if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
            raise ValueError(f"agent loop {name!r} is not a subclass of hybridflow.agent.loop.AgentLoopBase")
        return cls
    raise ValueError(f"unknown agent loop {name!r}: use one of {', '.join(AGENT_LOOPS)} or a dotted class path")
