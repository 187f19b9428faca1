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
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCall(name, None, raw, call_id, error=f"arguments are not valid JSON: {exc.msg}")
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
                obj = json.loads(body)
            except json.JSONDecodeError as exc:
                calls.append(ToolCall("", None, raw, f"call_{i}", error=f"malformed JSON in <tool_call>: {exc.msg}"))
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
            obj = json.loads(body)
            objs = obj if isinstance(obj, list) else [obj]
        except json.JSONDecodeError:
            parts = [p.strip() for p in body.split(";") if p.strip()]
            objs = []
            for p in parts:
                try:
                    objs.append(json.loads(p))
                except json.JSONDecodeError as exc:
                    return [ToolCall("", None, body, "call_0", error=f"malformed JSON tool call: {exc.msg}")]
        return [_call_from_obj(o, json.dumps(o) if not isinstance(o, str) else o, "parameters", i)
                for i, o in enumerate(objs)]


PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def get_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"Unknown tool_parser '{name}'. Known parsers: {', '.join(PARSERS)}.")
    return PARSERS[name]()
