"""Built-in generated tasks (seeded; no data sets are downloaded).

- `calculator`: multi-step arithmetic with the `calculator` tool; the answer goes after `####`.
- `feedback_math`: a short arithmetic question; a rule-based user (`math_feedback`) says whether the answer
  is right and asks again when it is not (multi-turn through a simulated user).
- `guess_number`: find a secret number; the user (`guess_number`) answers each guess with higher/lower.
Options are checked: an unknown option is an error.
"""

from __future__ import annotations

import json
import random
from typing import Any, Callable

from turnrl.data.rows import DataError, Task

SYSTEM = "You are a helpful assistant."


def _opts(options: dict[str, Any], defaults: dict[str, Any], task: str) -> dict[str, Any]:
    unknown = set(options) - set(defaults)
    if unknown:
        raise DataError(f"task '{task}': unknown option(s) {sorted(unknown)}; valid: {sorted(defaults)}")
    out = {**defaults, **options}
    for key, default in defaults.items():
        if type(out[key]) is not type(default):  # bool is not int here: `steps: true` is a mistake
            raise DataError(f"task '{task}': option '{key}' must be {type(default).__name__}, got {out[key]!r}")
    minimum = {"steps": 1, "max_value": 2, "max_attempts": 1}
    for key, low in minimum.items():
        if key in out and out[key] < low:
            raise DataError(f"task '{task}': option '{key}' must be at least {low}, got {out[key]}")
    if "low" in out and out["low"] > out["high"]:
        raise DataError(f"task '{task}': option 'low' ({out['low']}) is above 'high' ({out['high']})")
    return out


def _expression(rng: random.Random, steps: int, max_value: int) -> tuple[str, int]:
    value = rng.randint(2, max_value)
    text = str(value)
    for _ in range(steps):
        op, operand = rng.choice("+-*"), rng.randint(2, max_value)
        if op == "*" and abs(value) > 1000:
            op = "+"
        text = f"({text}) {op} {operand}" if op == "*" and ("+" in text or "-" in text) else f"{text} {op} {operand}"
        value = value + operand if op == "+" else value - operand if op == "-" else value * operand
    return text, value


def _calculator_question(expr: str) -> str:
    return (f"What is {expr}? Use the calculator tool to compute it, then give the final answer "
            f"on its own line as '#### <number>'.")


def calculator_demo(expr: str, value: int) -> list[dict[str, Any]]:
    """A worked example conversation: question, calculator call, result, `####` answer."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
    return [{"role": "user", "content": _calculator_question(expr)},
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "name": "calculator", "content": str(value)},
            {"role": "assistant", "content": f"The result is {value}.\n#### {value}"}]


def calculator(size: int, seed: int, options: dict[str, Any]) -> list[Task]:
    """`demo: true` puts one worked example (a different expression) before the question: small models
    rarely call tools from the schema alone, and with one example they do most of the time."""
    o = _opts(options, {"steps": 2, "max_value": 30, "demo": False}, "calculator")
    rng = random.Random(seed)
    tasks = []
    for i in range(size):
        expr, value = _expression(rng, o["steps"], o["max_value"])
        demo = calculator_demo(*_expression(rng, o["steps"], o["max_value"])) if o["demo"] else []
        tasks.append(Task(uid=f"calculator-{seed}-{i}", messages=[
            {"role": "system", "content": SYSTEM}, *demo, {"role": "user", "content": _calculator_question(expr)}],
            tools=["calculator"], ground_truth=str(value), data_source="calculator", index=i,
            demonstration=calculator_demo(expr, value)[1:],
            extra={"expression": expr}))
    return tasks


def feedback_math(size: int, seed: int, options: dict[str, Any]) -> list[Task]:
    o = _opts(options, {"steps": 1, "max_value": 20, "max_attempts": 3}, "feedback_math")
    rng = random.Random(seed)
    tasks = []
    for i in range(size):
        expr, value = _expression(rng, o["steps"], o["max_value"])
        tasks.append(Task(uid=f"feedback_math-{seed}-{i}", messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {expr}? Reply with just the number."}],
            tools=[], interaction={"name": "math_feedback", "ground_truth": str(value),
                                   "max_attempts": o["max_attempts"]},
            ground_truth=str(value), data_source="feedback_math", index=i, extra={"expression": expr},
            demonstration=[{"role": "assistant", "content": str(value)}]))
    return tasks


def guess_number(size: int, seed: int, options: dict[str, Any]) -> list[Task]:
    o = _opts(options, {"low": 1, "high": 20}, "guess_number")
    rng = random.Random(seed)
    tasks = []
    for i in range(size):
        secret = rng.randint(o["low"], o["high"])
        prompt = (f"I am thinking of a whole number between {o['low']} and {o['high']}. Guess it: reply with "
                  "one number per turn, and I will say higher or lower.")
        tasks.append(Task(uid=f"guess_number-{seed}-{i}", messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
            tools=[], interaction={"name": "guess_number", "secret": secret, "low": o["low"], "high": o["high"]},
            ground_truth=str(secret), data_source="guess_number", index=i))
    return tasks


TASKS: dict[str, Callable[[int, int, dict[str, Any]], list[Task]]] = {
    "calculator": calculator, "feedback_math": feedback_math, "guess_number": guess_number}


# Task sources that take only their options (the rows of another framework's environment); integrations above
# this layer register theirs here (turnrl.compat registers "verifiers").
TASK_SOURCES: dict[str, Callable[..., list[Task]]] = {}


def generate_task(name: str, size: int, seed: int, options: dict[str, Any]) -> list[Task]:
    if name in TASK_SOURCES:
        return TASK_SOURCES[name](**options)
    if name not in TASKS:
        raise DataError(f"unknown built-in task '{name}'; built-ins: {', '.join([*TASKS, *TASK_SOURCES])}")
    return TASKS[name](size, seed, options)
