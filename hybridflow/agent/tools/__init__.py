"""Tools the agent loop can call: the base class, the built-in calculator, the tool-config loader."""
from hybridflow.agent.tools.base import BaseTool, ToolResponse

__all__ = ["BaseTool", "ToolResponse"]
