"""A safe calculator tool: arithmetic on numbers only, evaluated from the Python AST (no eval)."""

from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Any

from turnrl.env.tools import ToolOutput

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_LENGTH = 200
MAX_BITS = 4096            # numerators and denominators up to ~1233 digits


def _bits(value: Fraction) -> int:
    return max(value.numerator.bit_length(), value.denominator.bit_length())


def evaluate(expression: str) -> Fraction:
    """Exact rational arithmetic on + - * / // % ** and parentheses; anything else is a ValueError.

    Decimal literals are read exactly (0.1 is 1/10); exponents and results are bounded so that no input of
    200 characters can keep the tool busy.
    """
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"expression longer than {MAX_LENGTH} characters")
    source = expression.replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            if isinstance(node.value, float):  # from the literal's text: 0.1 is 1/10, not the nearest binary float
                literal = (ast.get_source_segment(source, node) or repr(node.value)).replace("_", "")
                return Fraction(literal)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow):
                if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                    raise ValueError("exponents must be integers up to 64")
                if _bits(left) * abs(right) > MAX_BITS:  # (((10**64)**64)**64)**64 would run for minutes
                    raise ValueError("result too large")
                if left == 0 and right < 0:
                    raise ValueError("division by zero")
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            result = Fraction(OPS[type(node.op)](left, right))
            if _bits(result) > MAX_BITS:
                raise ValueError("result too large")
            return result
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            return UNARY[type(node.op)](walk(node.operand))
        raise ValueError(f"unsupported element {type(node).__name__}: only numbers and + - * / // % ** ( )")

    return walk(tree)


def format_number(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6g}"


class Calculator:
    name = "calculator"
    schema = {"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}},
            "required": ["expression"]}}}

    def __init__(self) -> None:
        self.calls = 0

    def create(self, **kwargs: Any) -> None:
        self.calls = 0

    def execute(self, args: dict[str, Any]) -> ToolOutput:
        self.calls += 1
        try:
            return ToolOutput(format_number(evaluate(str(args["expression"]))), metrics={"calls": self.calls})
        except ValueError as exc:
            return ToolOutput(f"Error: {exc}", metrics={"calls": self.calls, "invalid": 1})

    def reward(self) -> None:
        return None

    def release(self) -> None:
        return None
