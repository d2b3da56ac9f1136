"""A calculator tool: arithmetic parsed with ``ast`` and evaluated by walking the tree, never ``eval``.

Only numbers, + - * / // % **, unary +/- and parentheses are accepted. Inputs that could make
the worker spend unbounded time or memory are refused up front: long expressions, deep trees,
powers whose result would exceed ``max_digits`` digits, and any intermediate integer that grows
past that size. Every bad input comes back as an error text for the model to read.
"""
from __future__ import annotations

import ast
import math
import operator

from hybridflow.agent.tools.base import BaseTool, ToolResponse

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
ALLOWED = "numbers, + - * / // % **, unary minus and parentheses"

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (" + ALLOWED + ") and return the result.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example (12 + 7) * 3"}},
            "required": ["expression"],
        },
    },
}


class CalcError(ValueError):
    """An expression the calculator refuses; the message is what the model reads."""


class Evaluator:
    def __init__(self, max_digits: int = 100, max_nodes: int = 200):
        self.max_digits, self.max_nodes = max_digits, max_nodes
        self.nodes = 0

    def _check(self, value):
        if isinstance(value, int) and value and math.log10(abs(value)) >= self.max_digits:
            raise CalcError(f"result has more than {self.max_digits} digits")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalcError("result is not a finite number")
        return value

    def _power(self, base, exp):
        # |base|**exp has about exp*log10|base| digits: refuse before computing it
        if abs(exp) > 0 and abs(base) > 1 and abs(exp) * math.log10(abs(base)) >= self.max_digits:
            raise CalcError(f"power too large (the result would exceed {self.max_digits} digits)")
        if base == 0 and exp < 0:
            raise CalcError("division by zero")
        result = base ** exp
        if isinstance(result, complex):
            raise CalcError("fractional power of a negative number is not a real number")
        return result

    def eval(self, node):
        self.nodes += 1
        if self.nodes > self.max_nodes:
            raise CalcError(f"expression too long (more than {self.max_nodes} parts)")
        if isinstance(node, ast.Expression):
            return self.eval(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self.eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.eval(node.left), self.eval(node.right)
            if isinstance(node.op, ast.Pow):
                return self._check(self._power(left, right))
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise CalcError("division by zero")
            return self._check(_BINARY[type(node.op)](left, right))
        what = {ast.Name: "name", ast.Call: "function call", ast.Attribute: "attribute"}.get(type(node), "")
        detail = f" {what} {ast.unparse(node)!r}" if what else f" {ast.unparse(node)!r}"
        raise CalcError(f"not allowed:{detail}; only {ALLOWED}")


def format_number(value) -> str:
    """Integers as integers (6/3 -> "2"), other floats to 12 significant digits."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".12g")
    return str(value)


def calculate(expression: str, max_length: int = 200, max_digits: int = 100) -> str:
    """The result as text, or raises CalcError with a message for the model."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalcError("give the expression as a non-empty string")
    if len(expression) > max_length:
        raise CalcError(f"expression longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalcError(f"cannot parse {expression!r}; use {ALLOWED}") from None
    try:
        return format_number(Evaluator(max_digits).eval(tree))
    except (OverflowError, RecursionError):
        raise CalcError("number too large") from None


class CalculatorTool(BaseTool):
    """Config keys: ``timeout_s``, ``max_length`` (characters, default 200), ``max_digits`` (default 100)."""

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config or {}, tool_schema or SCHEMA)
        self.max_length = int(self.config.get("max_length", 200))
        self.max_digits = int(self.config.get("max_digits", 100))

    async def execute(self, instance_id: str, parameters: dict, **kwargs):
        # cheap (bounded sizes), so it runs on the event loop; a heavier tool would use asyncio.to_thread
        try:
            text = calculate((parameters or {}).get("expression"), self.max_length, self.max_digits)
            return ToolResponse(text), None, {"ok": 1.0}
        except CalcError as e:
            return ToolResponse(f"Error: {e}"), None, {"ok": 0.0}
