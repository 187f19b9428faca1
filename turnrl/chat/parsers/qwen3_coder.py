"""The Qwen3-Coder XML tool-call format (also Qwen3.5 and Nemotron 3):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Each parameter's text is its value with the newline the template writes on each side removed. The template
writes strings as they are, objects and lists as JSON, and other values with Jinja's `string` filter (`3`,
`True`, `None`), so a value that reads as JSON or as one of Python's `True`/`False`/`None` is converted and
anything else stays a string (a string parameter whose text is `42` therefore arrives as the number 42; tools
that need a string should convert, as with any model-written value).
"""

from __future__ import annotations

import json
import re
from typing import Any

from turnrl.chat.parsers.common import failed, strip_reasoning
from turnrl.ledger import ToolCall

CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(</function>|$)", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(</parameter>|(?=<parameter=)|$)", re.DOTALL)
PYTHON_WORDS = {"True": True, "False": False, "None": None}


class Qwen3CoderParser:
    name = "qwen3_coder"
    call_markers = ("<tool_call>", "<function=")

    def forced_opening(self, function: str | None) -> str:
        """As the template writes it: `<tool_call>\n<function=NAME>\n` then the parameters."""
        return "<tool_call>\n<function=" if function is None else f"<tool_call>\n<function={function}>\n"

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for i, match in enumerate(CALL.finditer(strip_reasoning(text))):
            raw = match.group(0)
            if not match.group(2):
                calls.append(failed(raw, i, "unterminated <tool_call> (no </tool_call>)"))
                continue
            function = FUNCTION.search(match.group(1))
            if function is None:
                calls.append(failed(raw, i, "<tool_call> holds no <function=NAME> block"))
                continue
            name = function.group(1).strip()
            if not name:
                calls.append(failed(raw, i, "<function=...> has no name"))
                continue
            if not function.group(3):
                calls.append(failed(raw, i, f"<function={name}> is not closed (no </function>)", name))
                continue
            args: dict[str, Any] = {}
            error = None
            for param in PARAMETER.finditer(function.group(2)):
                key = param.group(1).strip()
                if not key:
                    error = "a <parameter=...> has no name"
                    break
                if not param.group(3):
                    error = f"<parameter={key}> is not closed (no </parameter>)"
                    break
                args[key] = _value(param.group(2))
            calls.append(failed(raw, i, error, name) if error else ToolCall(name, args, raw, f"call_{i}"))
        return calls


def _value(text: str) -> Any:
    text = text[1:] if text.startswith("\n") else text
    text = text[:-1] if text.endswith("\n") else text
    if text in PYTHON_WORDS:
        return PYTHON_WORDS[text]
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text
