"""hybridflow/agent/tools/config.py: verl's tool-config YAML; every problem is one line naming the
file, the entry and the fix, and found before any worker starts."""
import textwrap

import pytest

from hybridflow.agent.tools.calculator import CalculatorTool
from hybridflow.agent.tools.config import load_tools, tool_config_errors

CALC = """
  - class_name: hybridflow.agent.tools.calculator.CalculatorTool
    config: {type: native, timeout_s: 5}
    tool_schema:
      type: function
      function:
        name: calculator
        description: arithmetic
        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
"""


def write(tmp_path, text, name="tools.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_a_valid_file_loads_tools_by_name_with_their_config(tmp_path):
    path = write(tmp_path, "tools:" + CALC)
    assert tool_config_errors(path) == []
    tools = load_tools(path)
    assert list(tools) == ["calculator"]
    assert isinstance(tools["calculator"], CalculatorTool) and tools["calculator"].timeout_s == 5.0
    assert tools["calculator"].get_openai_tool_schema()["function"]["description"] == "arithmetic"


def entry(class_name="hybridflow.agent.tools.calculator.CalculatorTool", config="{type: native}",
          schema="{type: function, function: {name: calc, parameters: {type: object}}}"):
    return f"\n  - class_name: {class_name}\n    config: {config}\n    tool_schema: {schema}\n"


@pytest.mark.parametrize("body, expected", [
    ("tools:" + entry(class_name="no_such_pkg.mod.Tool"), "tools[0] (calc): class_name 'no_such_pkg.mod.Tool' cannot be imported"),
    ("tools:" + entry(class_name="Calculator"), "dotted path"),
    ("tools:" + entry(class_name="collections.OrderedDict"), "is not a subclass of hybridflow.agent.tools.base.BaseTool"),
    ("tools:" + entry(schema="{type: function, function: {description: x}}"), "tool_schema.function.name is missing"),
    ("tools:" + entry(schema="{name: calc}"), "OpenAI function schema"),
    ("tools:" + entry(config="{type: native, timeout_s: 0}"), "config.timeout_s is 0: give a positive number"),
    ("tools:" + entry(config="{type: mcp}"), "only 'native'"),
    ("tools:" + entry(config="[1]"), "config is list"),
    ("tools:" + entry() + entry(), "tools[1] (calc): a second tool named 'calc'"),
    ("tools: []", "the 'tools' list is empty"),
    ("tool: []", "has no 'tools' list"),
    ("tools: [1, 2", "cannot be read as YAML"),
])
def test_each_problem_is_one_line_naming_the_file_and_entry(tmp_path, body, expected):
    path = write(tmp_path, body)
    errors = tool_config_errors(path)
    assert len(errors) == 1 and expected in errors[0] and errors[0].startswith(path), errors
    assert "\n" not in errors[0]
    with pytest.raises(ValueError, match="tool config errors"):
        load_tools(path)


def test_a_missing_file_and_an_empty_path_are_named(tmp_path):
    assert tool_config_errors(str(tmp_path / "nope.yaml")) == [f"{tmp_path / 'nope.yaml'}: no such file: give an "
                                                                "existing tool-config YAML (tools: [...])"]
    assert "tool_config_path is empty" in tool_config_errors("")[0]


def test_every_bad_entry_is_reported_not_only_the_first(tmp_path):
    path = write(tmp_path, "tools:" + entry(class_name="x.Y") + entry(config="{timeout_s: -1}") + CALC)
    errors = tool_config_errors(path)
    assert [e.split(": ")[1] for e in errors] == ["tools[0] (calc)", "tools[1] (calc)"]
