"""What every tool-call parser shares: the protocol, reasoning stripping, and JSON helpers that never raise
anything but `ValueError`.

A parser turns assistant text into `ToolCall`s. A call that cannot be parsed is still returned, with `error`
set, so the agent loop can tell the model what went wrong and count it; it never disappears silently.
Calls written inside `<think>...</think>` are reasoning, not actions, and are ignored.

A parser also writes the opening of a call (`forced_opening`), which the gateway puts ahead of the model's
reply for `tool_choice: required` or a named function: the model can then only continue a call. The opening
stops where the format's tokenizers split (before a name's first letter after a quote, after `":` rather than
before the space that the next token carries), so the ledger's tokens stay those of a full render. A format
whose opening depends on the model's version (Mistral v3 / v11 named calls, DeepSeek V3 / V3.1) raises
`CannotForce` instead of guessing.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from turnrl.ledger import ToolCall

THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)


class CannotForce(ValueError):
    """The format cannot write this call's opening ahead of the model; the message says why."""


class ToolCallParser(Protocol):
    name: str
    call_markers: tuple[str, ...]      # text that may open a call: a stream holds its content back from there

    def parse(self, text: str) -> list[ToolCall]: ...

    def forced_opening(self, function: str | None) -> str:
        """The text every call starts with (`function` None: any tool), or that of a call to `function`."""
        ...


def strip_reasoning(text: str) -> str:
    return THINK.sub("", text)


def loads(text: str) -> Any:
    """`json.loads` whose every failure is a `ValueError` (deeply nested input raises RecursionError)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def error_text(exc: ValueError) -> str:
    return exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)


def failed(raw: str, index: int, error: str, name: str = "") -> ToolCall:
    return ToolCall(name, None, raw, f"call_{index}", error=error)


def call_from_obj(obj: Any, raw: str, args_key: str, index: int) -> ToolCall:
    """A `{"name": ..., args_key: {...}}` object (arguments may also be a JSON string) -> a call."""
    if not isinstance(obj, dict):
        return failed(raw, index, f"a tool call must be a JSON object with 'name' and '{args_key}'")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return failed(raw, index, "the tool call has no 'name' string")
    return call_from_args(name, obj.get(args_key, obj.get("arguments", obj.get("parameters", {}))), raw, index,
                          args_key)


def call_from_args(name: str, args: Any, raw: str, index: int, args_key: str = "arguments") -> ToolCall:
    if isinstance(args, str):  # some models (and templates) write the arguments as a JSON string
        try:
            args = loads(args) if args.strip() else {}
        except ValueError as exc:
            return failed(raw, index, f"arguments are not valid JSON: {error_text(exc)}", name)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return failed(raw, index, f"'{args_key}' must be a JSON object", name)
    return ToolCall(name, args, raw, f"call_{index}")


def separated_values(body: str, separator: str = ";") -> list[Any]:
    """`{...}; {...}` -> the JSON values, read one after the other (a separator inside a string stays in it)."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    at = 0
    while True:
        while at < len(body) and (body[at].isspace() or (values and body[at] == separator)):
            at += 1
        if at == len(body):
            return values
        try:
            value, at = decoder.raw_decode(body, at)
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None
        values.append(value)
        rest = body[at:].lstrip()
        if rest and not rest.startswith(separator):
            raise ValueError(f"expected '{separator}' between tool calls at char {len(body) - len(rest)}")
