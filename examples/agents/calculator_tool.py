"""The calculator the example agents give the model: the same schema and exact arithmetic as turnrl's built-in
`calculator` tool, so an agent run through the gateway sees the same prompt as the native agent loop."""

from turnrl.env.builtin.calculator import Calculator, evaluate, format_number

SCHEMA = Calculator.schema
DESCRIPTION = SCHEMA["function"]["description"]


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses."""
    try:
        return format_number(evaluate(expression))
    except (ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"


def exact_reward(answer: str, truth) -> float:
    """1 when the text ends its answer with '#### N' and N is the ground truth."""
    import re
    found = re.findall(r"####\s*(-?[\d,]*\.?\d+)", answer or "")
    if not found:
        return 0.0
    try:
        return float(abs(float(found[-1].replace(",", "")) - float(truth)) < 1e-6)
    except (TypeError, ValueError):
        return 0.0


def with_call_ids(messages: list[dict]) -> list[dict]:
    """The task's worked example as a client library wants it: each tool result answers a tool call id."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m["role"] == "tool":
            m.setdefault("tool_call_id", f"demo_{i}")
        out.append(m)
    return out
