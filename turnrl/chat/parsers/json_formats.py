"""Tool-call formats whose arguments are JSON: hermes, llama3_json, mistral, deepseek_v3.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per message (Hermes,
  Qwen2.5/3, and the prompt turnrl injects for templates without native tools).
- `llama3_json`: the whole message (optionally after `<|python_tag|>`) is one JSON object
  `{"name": ..., "parameters": {...}}` or a list of them, or several objects separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON list `[{"name": ..., "arguments": ..., "id": ...}]` (Mistral 7B v0.3,
  Mixtral, Nemo: the arguments may be an object or a JSON string), or, from the v11 tokenizer on,
  `[TOOL_CALLS]name[ARGS]{...}` once per call (optionally `name[CALL_ID]id[ARGS]{...}`).
- `deepseek_v3`: `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and the
  arguments in a ```json fence, closed by `<｜tool▁call▁end｜>` (DeepSeek-V3/R1); V3.1 writes
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`. Both are read.
"""

from __future__ import annotations

import json
import re

from turnrl.chat.parsers.common import (CannotForce, call_from_args, call_from_obj, error_text, failed, loads,
                                        separated_values, strip_reasoning)
from turnrl.ledger import ToolCall

HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


class HermesParser:
    name = "hermes"
    call_markers = ("<tool_call>",)

    def forced_opening(self, function: str | None) -> str:
        """As turnrl's injected prompt and the templates write it: `<tool_call>\n{"name": "NAME", "arguments": ...`."""
        if function is None:
            return '<tool_call>\n{"name": "'
        return f'<tool_call>\n{{"name": {json.dumps(function, ensure_ascii=False)}, "arguments":'

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for i, match in enumerate(HERMES.finditer(strip_reasoning(text))):
            body, closed = match.group(1).strip(), bool(match.group(2))
            raw = match.group(0)
            if not closed:
                calls.append(failed(raw, i, "unterminated <tool_call> (no </tool_call>)"))
                continue
            try:
                obj = loads(body)
            except ValueError as exc:
                calls.append(failed(raw, i, f"malformed JSON in <tool_call>: {error_text(exc)}"))
                continue
            calls.append(call_from_obj(obj, raw, "arguments", i))
        return calls


class Llama3JsonParser:
    name = "llama3_json"
    call_markers = ("{", "<|python_tag|>")

    def forced_opening(self, function: str | None) -> str:
        """Llama 3.1's template writes `{"name": "NAME", "parameters": ...}` (the parser also reads `arguments`)."""
        if function is None:
            return '{"name": "'
        return f'{{"name": {json.dumps(function, ensure_ascii=False)}, "parameters":'

    def parse(self, text: str) -> list[ToolCall]:
        body = strip_reasoning(text).strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith(("{", "[")):
            return []
        try:
            objs = separated_values(body)
        except ValueError as exc:
            return [failed(body, 0, f"malformed JSON tool call: {error_text(exc)}")]
        if len(objs) == 1 and isinstance(objs[0], list):
            objs = objs[0]
        return [call_from_obj(o, json.dumps(o, ensure_ascii=False), "parameters", i) for i, o in enumerate(objs)]


MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_JSON = re.compile(r"\{|\[\s*[{\]]")  # a JSON list of objects (or one object), not NAME[ARGS]


class MistralParser:
    name = "mistral"
    call_markers = ("[TOOL_CALLS]",)

    def forced_opening(self, function: str | None) -> str:
        """`[TOOL_CALLS]` opens a call in both versions; what follows it (a JSON list or NAME[ARGS]) does not."""
        if function is None:
            return MISTRAL_CALLS
        raise CannotForce("a named call is a JSON list after [TOOL_CALLS] for Mistral v3 tokenizers and "
                          "NAME[ARGS] from v11 on, and the parser cannot tell which this model writes")

    def parse(self, text: str) -> list[ToolCall]:
        body = strip_reasoning(text)
        at = body.find(MISTRAL_CALLS)
        if at < 0:
            return []
        calls: list[ToolCall] = []
        for piece in body[at:].split(MISTRAL_CALLS)[1:]:
            raw = MISTRAL_CALLS + piece
            piece = piece.strip()
            if MISTRAL_JSON.match(piece):
                calls += self._json_list(piece, raw, len(calls))
            else:
                calls.append(self._named(piece, raw, len(calls)))
        return calls

    @staticmethod
    def _json_list(piece: str, raw: str, first: int) -> list[ToolCall]:
        try:
            value, _ = json.JSONDecoder().raw_decode(piece)
        except RecursionError:
            return [failed(raw, first, "malformed JSON after [TOOL_CALLS]: JSON nested too deeply")]
        except ValueError as exc:
            return [failed(raw, first, f"malformed JSON after [TOOL_CALLS]: {error_text(exc)}")]
        objs = value if isinstance(value, list) else [value]
        if not objs:
            return [failed(raw, first, "[TOOL_CALLS] is followed by an empty list")]
        return [call_from_obj(o, json.dumps(o, ensure_ascii=False), "arguments", first + k) for k, o in enumerate(objs)]

    @staticmethod
    def _named(piece: str, raw: str, index: int) -> ToolCall:
        if "[ARGS]" not in piece:
            return failed(raw, index, "[TOOL_CALLS] must be followed by a JSON list or by NAME[ARGS]{...}")
        head, args = piece.split("[ARGS]", 1)
        name = head.split("[CALL_ID]", 1)[0].strip()
        if not name:
            return failed(raw, index, "the tool call has no name before [ARGS]")
        try:
            value, _ = json.JSONDecoder().raw_decode(args.strip())
        except RecursionError:
            return failed(raw, index, "arguments are not valid JSON: JSON nested too deeply", name)
        except ValueError as exc:
            return failed(raw, index, f"arguments are not valid JSON: {error_text(exc)}", name)
        return call_from_args(name, value, raw, index)


DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALL_BEGIN, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
DS_CALL = re.compile(re.escape(DS_CALL_BEGIN) + r"(.*?)(" + re.escape(DS_CALL_END) + "|$)", re.DOTALL)


class DeepSeekV3Parser:
    name = "deepseek_v3"
    call_markers = (DS_CALLS_BEGIN, DS_CALL_BEGIN)

    def forced_opening(self, function: str | None) -> str:
        """Both versions open with the calls and call markers; the name comes after `function<｜tool▁sep｜>` in
        V3/R1 and before `<｜tool▁sep｜>` in V3.1."""
        if function is None:
            return DS_CALLS_BEGIN + DS_CALL_BEGIN
        raise CannotForce("DeepSeek V3/R1 writes a named call as function<｜tool▁sep｜>NAME and V3.1 as "
                          "NAME<｜tool▁sep｜>, and the parser cannot tell which this model writes")

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for i, match in enumerate(DS_CALL.finditer(strip_reasoning(text))):
            inner, raw = match.group(1), match.group(0)
            if not match.group(2):
                calls.append(failed(raw, i, f"unterminated tool call (no {DS_CALL_END})"))
            elif DS_SEP not in inner:
                calls.append(failed(raw, i, f"the tool call has no {DS_SEP} between its name and arguments"))
            else:
                calls.append(self._call(*inner.split(DS_SEP, 1), raw, i))
        return calls

    @staticmethod
    def _call(left: str, right: str, raw: str, index: int) -> ToolCall:
        if left.strip() == "function" and "\n" in right:  # V3/R1: type, then the name line and a ```json fence
            name, args = right.split("\n", 1)
            args = args.strip()
            if args.startswith("```"):  # the fence's first line (```json) and last (```); a ``` inside a string stays
                args = args.split("\n", 1)[1] if "\n" in args else ""
                args = args.rstrip()[:-3] if args.rstrip().endswith("```") else args
        else:  # V3.1: the name, then the arguments
            name, args = left, right
        name = name.strip()
        if not name:
            return failed(raw, index, "the tool call has no name")
        return call_from_args(name, args.strip(), raw, index)
