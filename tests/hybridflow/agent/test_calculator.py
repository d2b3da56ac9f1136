"""hybridflow/agent/tools/calculator.py: safe arithmetic by walking the ast; refusals come back as text."""
import asyncio

import pytest

from hybridflow.agent.tools.base import ToolResponse
from hybridflow.agent.tools.calculator import CalculatorTool


def run(expression, **config):
    response, reward, metrics = asyncio.run(CalculatorTool(config).execute("i", {"expression": expression}))
    assert isinstance(response, ToolResponse) and reward is None
    return response.text


@pytest.mark.parametrize("expression, result", [
    ("(12 + 7) * 3", "57"), ("6 / 3", "2"), ("7 / 2", "3.5"), ("7 // 2", "3"), ("-7 % 3", "2"), ("2 ** 10", "1024"),
    ("-(3 - 5)", "2"), ("2 ** -1", "0.5"), ("1 / 3", "0.333333333333"), ("10 ** 99", "1" + "0" * 99),
])
def test_arithmetic(expression, result):
    assert run(expression) == result


@pytest.mark.parametrize("expression, message", [
    ("1 / 0", "division by zero"), ("5 // 0", "division by zero"), ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2 ** 100000", "power too large"), ("9 ** 9 ** 9", "power too large"), ("10 ** 100", "power too large"),
    ("99999999999 ** 9 * 99999999999 ** 9 * 99999999999 ** 9", "more than 100 digits"),
    ("1e308 * 10", "not a finite number"), ("(-8) ** 0.5", "not a real number"),
    ("x + 1", "name 'x'"), ("__import__('os').system('true')", "not allowed"), ("abs(-1)", "function call"),
    ("(1).real", "not allowed"), ("[1, 2]", "not allowed"), ("True + 1", "not allowed"), ("'a' * 3", "not allowed"),
    ("1 +", "cannot parse"), ("", "non-empty string"), ("1+" * 150 + "1", "longer than 200 characters"),
])
def test_refusals_are_error_texts(expression, message):
    text = run(expression)
    assert text.startswith("Error: ") and message in text, text


def test_a_missing_or_non_string_expression_is_an_error_text():
    tool = CalculatorTool()
    for params in ({}, {"expression": 12}, None):
        assert asyncio.run(tool.execute("i", params))[0].text.startswith("Error: ")


def test_limits_are_configurable_and_the_schema_names_the_tool():
    assert run("2 ** 20", max_digits=5).startswith("Error: power too large")
    assert run("1 + 1 + 1", max_length=4).startswith("Error: expression longer")
    tool = CalculatorTool({"timeout_s": 2})
    assert tool.name == "calculator" and tool.timeout_s == 2.0
    assert tool.get_openai_tool_schema()["function"]["parameters"]["required"] == ["expression"]
