"""The pythonic tool-call format: a Python list of calls with keyword arguments, `[f(a=1), g(b="x")]`.

Llama 3.2 (1B/3B) and Llama 4 write their calls this way, optionally wrapped in `<|python_start|>` and
`<|python_end|>` (Llama 4), after some text (Llama 4) or as the whole message (Llama 3.2). The list is read
with Python's own parser (`ast`), and each argument must be a Python literal (`ast.literal_eval`): nothing is
ever evaluated. A list whose items are not all calls (`[1, 2]`, `[see above]`) is text, not a tool call.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from turnrl.chat.parsers.common import failed, strip_reasoning
from turnrl.ledger import ToolCall

# Where a call list may start: '[' then a (dotted) name and '('.
CALL_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
TAGS = ("<|python_start|>", "<|python_end|>", "<|python_tag|>")


class PythonicParser:
    name = "pythonic"
    call_markers = ("[",) + TAGS

    def forced_opening(self, function: str | None) -> str:
        """`[` then the call (`<|python_start|>`, which Llama 4 may write first, is optional for the parser)."""
        return "[" if function is None else f"[{function}("

    def parse(self, text: str) -> list[ToolCall]:
        body = strip_reasoning(text)
        for tag in TAGS:
            body = body.replace(tag, "")
        body = body.strip()
        if not body.endswith("]"):
            return []
        starts = [m.start() for m in CALL_START.finditer(body)]
        if not starts:
            return []
        error = ""
        for start in starts:  # the first '[' from which the rest of the message is one list of calls
            raw = body[start:]
            try:
                tree = ast.parse(raw, mode="eval").body
            except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
                error = error or f"not a Python list of calls: {type(exc).__name__}: {getattr(exc, 'msg', exc)}"
                continue
            if isinstance(tree, ast.List) and tree.elts and all(isinstance(e, ast.Call) for e in tree.elts):
                return [_call(e, raw, i) for i, e in enumerate(tree.elts)]
            error = error or "every item of the list must be a call, e.g. [f(a=1), g(b=\"x\")]"
        # A message that opens with a call list but does not parse is a failed call; a call list somewhere
        # inside prose that does not parse is prose.
        return [failed(body, 0, error or "not a Python list of calls")] if starts[0] == 0 else []


def _call(node: ast.Call, raw: str, index: int) -> ToolCall:
    name = _dotted(node.func)
    if name is None:
        return failed(raw, index, "a call must name a function, e.g. [get_weather(city=\"Paris\")]")
    if node.args:
        return failed(raw, index, f"{name}: write the arguments as keywords (name=value), not by position", name)
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            return failed(raw, index, f"{name}: '**' arguments are not allowed", name)
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return failed(raw, index, f"{name}: argument '{kw.arg}' is not a Python literal (quote strings)", name)
    return ToolCall(name, args, raw, f"call_{index}")


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None
