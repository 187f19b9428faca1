"""Tool-call parsers: assistant text -> tool calls.

A parser is any object with a `parse(text) -> list[ToolCall]` method; `PARSERS` maps config names to them.
Calls written inside `<think>...</think>` are reasoning, not actions, and are ignored. A call that cannot
be parsed is still returned, with `error` set, so the agent loop can tell the model what went wrong and
count it; it never disappears silently.

Formats:
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per message (Hermes,
  Qwen2.5/3, and the prompt turnrl injects for templates without native tools).
- `llama3_json`: the whole message (optionally after `<|python_tag|>`) is one JSON object
  `{"name": ..., "parameters": {...}}` or a list of them, or several objects separated by `;`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from turnrl.ledger import ToolCall

THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


class ToolCallParser(Protocol):
    def parse(self, text: str) -> list[ToolCall]: ...


def strip_reasoning(text: str) -> str:
    return THINK.sub("", text)


def _loads(text: str) -> Any:
    """`json.loads` whose every failure is a `ValueError` (deeply nested input raises RecursionError)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _error_text(exc: ValueError) -> str:
    return exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)


def _call_from_obj(obj: Any, raw: str, args_key: str, index: int) -> ToolCall:
    call_id = f"call_{index}"
    if not isinstance(obj, dict):
        return ToolCall("", None, raw, call_id, error="a tool call must be a JSON object with 'name' and "
                                                      f"'{args_key}'")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", None, raw, call_id, error="the tool call has no 'name' string")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = _loads(args) if args.strip() else {}
        except ValueError as exc:
            return ToolCall(name, None, raw, call_id, error=f"arguments are not valid JSON: {_error_text(exc)}")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(name, None, raw, call_id, error=f"'{args_key}' must be a JSON object")
    return ToolCall(name, args, raw, call_id)


class HermesParser:
    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for i, match in enumerate(HERMES.finditer(strip_reasoning(text))):
            body, closed = match.group(1).strip(), bool(match.group(2))
            raw = match.group(0)
            if not closed:
                calls.append(ToolCall("", None, raw, f"call_{i}", error="unterminated <tool_call> (no </tool_call>)"))
                continue
            try:
                obj = _loads(body)
            except ValueError as exc:
                calls.append(ToolCall("", None, raw, f"call_{i}",
                                      error=f"malformed JSON in <tool_call>: {_error_text(exc)}"))
                continue
            calls.append(_call_from_obj(obj, raw, "arguments", i))
        return calls


class Llama3JsonParser:
    def parse(self, text: str) -> list[ToolCall]:
        body = strip_reasoning(text).strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith(("{", "[")):
            return []
        try:
            objs = _separated_values(body)
        except ValueError as exc:
            return [ToolCall("", None, body, "call_0", error=f"malformed JSON tool call: {_error_text(exc)}")]
        if len(objs) == 1 and isinstance(objs[0], list):
            objs = objs[0]
        return [_call_from_obj(o, json.dumps(o, ensure_ascii=False), "parameters", i) for i, o in enumerate(objs)]


def _separated_values(body: str) -> list[Any]:
    """`{...}; {...}` -> the JSON values, read one after the other (a ';' inside a string stays in it)."""
    decoder = json.JSONDecoder()
    values, at = [], 0
    while True:
        while at < len(body) and (body[at].isspace() or (values and body[at] == ";")):
            at += 1
        if at == len(body):
            return values
        try:
            value, at = decoder.raw_decode(body, at)
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None
        values.append(value)
        rest = body[at:].lstrip()
        if rest and not rest.startswith(";"):
            raise ValueError(f"expected ';' between tool calls at char {len(body) - len(rest)}")


PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def get_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"Unknown tool_parser '{name}'. Known parsers: {', '.join(PARSERS)}.")
    return PARSERS[name]()
