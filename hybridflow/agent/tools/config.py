"""The tool config: verl's YAML format, loaded into tool instances by class path.

    tools:
      - class_name: hybridflow.agent.tools.calculator.CalculatorTool
        config: {type: native, timeout_s: 5}
        tool_schema:
          type: function
          function: {name: calculator, description: ..., parameters: {type: object, properties: ...}}

``tool_config_errors(path)`` checks a file (imports the classes and builds the tools) and returns
one line per problem naming the file, the entry and the fix, so config validation can refuse a bad
file before any worker starts; ``load_tools(path)`` raises with the same lines.
"""
from __future__ import annotations

import importlib
import os

from hybridflow.agent.tools.base import BaseTool

TOOL_TYPES = ("native",)  # verl also has mcp; not supported here


def import_class(dotted: str):
    module, _, name = dotted.rpartition(".")
    if not module:
        raise ImportError(f"{dotted!r} is not a dotted path 'package.module.Class'")
    return getattr(importlib.import_module(module), name)


def _read(path: str) -> tuple[list | None, list[str]]:
    import yaml

    if not path:
        return None, ["tool_config_path is empty: give the path of a tool-config YAML"]
    if not os.path.isfile(path):
        return None, [f"{path}: no such file: give an existing tool-config YAML (tools: [...])"]
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, [f"{path}: cannot be read as YAML ({first}): fix the file's syntax"]
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        return None, [f"{path}: has no 'tools' list at the top level: write 'tools:' followed by a list of "
                       "entries with class_name, config and tool_schema"]
    return data["tools"], []


def _entry_errors(where: str, entry) -> list[str]:
    if not isinstance(entry, dict):
        return [f"{where}: is {type(entry).__name__}, not a mapping: give class_name, config and tool_schema"]
    errors = []
    if not isinstance(entry.get("class_name"), str) or "." not in entry.get("class_name", ""):
        errors.append(f"{where}: class_name is {entry.get('class_name')!r}: give the tool's class as a dotted "
                      "path 'package.module.Class'")
    config = entry.get("config", {})
    if config is not None and not isinstance(config, dict):
        errors.append(f"{where}: config is {type(config).__name__}: give a mapping (type: native, timeout_s: ...)")
    else:
        config = config or {}
        if config.get("type", "native") not in TOOL_TYPES:
            errors.append(f"{where}: config.type is {config.get('type')!r}: only 'native' (a python class) is "
                          "supported")
        t = config.get("timeout_s", 10.0)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            errors.append(f"{where}: config.timeout_s is {t!r}: give a positive number of seconds")
    schema = entry.get("tool_schema")
    fn = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(fn, dict):
        errors.append(f"{where}: tool_schema must be {{type: function, function: {{name, description, "
                      "parameters}}}} (an OpenAI function schema)")
    elif not isinstance(fn.get("name"), str) or not fn["name"]:
        errors.append(f"{where}: tool_schema.function.name is missing: give the name the model calls the tool by")
    elif "parameters" in fn and not isinstance(fn["parameters"], dict):
        errors.append(f"{where}: tool_schema.function.parameters must be a JSON-schema object")
    return errors


def _name(entry) -> str | None:
    schema = entry.get("tool_schema") if isinstance(entry, dict) else None
    fn = schema.get("function") if isinstance(schema, dict) else None
    return fn.get("name") if isinstance(fn, dict) and isinstance(fn.get("name"), str) else None


def _build(path: str) -> tuple[dict[str, BaseTool], list[str]]:
    entries, errors = _read(path)
    tools: dict[str, BaseTool] = {}
    for i, entry in enumerate(entries or []):
        name = _name(entry)
        where = f"{path}: tools[{i}]" + (f" ({name})" if name else "")
        problems = _entry_errors(where, entry)
        if problems:
            errors += problems
            continue
        try:
            cls = import_class(entry["class_name"])
        except Exception as e:  # ImportError, AttributeError, or the module failing at import
            errors.append(f"{where}: class_name {entry['class_name']!r} cannot be imported ({type(e).__name__}: "
                          f"{e}): give a class importable on the workers")
            continue
        if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
            errors.append(f"{where}: {entry['class_name']} is not a subclass of hybridflow.agent.tools.base.BaseTool: "
                          "subclass it")
            continue
        if name in tools:
            errors.append(f"{where}: a second tool named {name!r}: tool names must be unique")
            continue
        try:
            tools[name] = cls(dict(entry.get("config") or {}), entry["tool_schema"])
        except Exception as e:
            errors.append(f"{where}: {entry['class_name']}(config, tool_schema) raised {type(e).__name__}: {e}")
    if entries is not None and not entries and not errors:
        errors.append(f"{path}: the 'tools' list is empty: add at least one tool or turn multi_turn off")
    return tools, errors


def tool_config_errors(path: str) -> list[str]:
    """One line per problem of the tool-config file (empty when it loads)."""
    return _build(path)[1]


def load_tools(path: str) -> dict[str, BaseTool]:
    """name -> tool for every entry of the file; ValueError listing every problem."""
    tools, errors = _build(path)
    if errors:
        raise ValueError("tool config errors:\n" + "\n".join(errors))
    return tools
