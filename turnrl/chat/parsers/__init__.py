"""Tool-call parsers: assistant text -> tool calls, one parser per model family's format.

A parser is any object with a `name`, a `parse(text) -> list[ToolCall]` method and a
`forced_opening(function) -> str` method (how a call starts, for `tool_choice: required` or a named function;
`CannotForce` where the format cannot tell); `PARSERS` maps config names
(`rollout.tool_parser`) to them, and `turnrl.chat.detect` picks one from what a chat template renders
(`tool_parser: auto`). Formats and their modules:
- json_formats: `hermes` (Hermes, Qwen2.5/3, turnrl's injected prompt), `llama3_json` (Llama 3.1/3.2 JSON),
  `mistral` (`[TOOL_CALLS]`), `deepseek_v3` (DeepSeek-V3/R1/V3.1 tool-call special tokens);
- qwen3_coder: `qwen3_coder` (`<tool_call><function=...><parameter=...>`: Qwen3-Coder, Qwen3.5);
- pythonic: `pythonic` (`[f(a=1)]`: Llama 3.2, Llama 4).
Every parser ignores calls inside `<think>...</think>`, never raises, and returns a call it cannot read with
`error` set (common.py).
"""

from __future__ import annotations

from turnrl.chat.parsers.common import CannotForce, ToolCallParser, strip_reasoning
from turnrl.chat.parsers.json_formats import DeepSeekV3Parser, HermesParser, Llama3JsonParser, MistralParser
from turnrl.chat.parsers.pythonic import PythonicParser
from turnrl.chat.parsers.qwen3_coder import Qwen3CoderParser

PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "qwen3_coder": Qwen3CoderParser,
                            "pythonic": PythonicParser, "mistral": MistralParser, "deepseek_v3": DeepSeekV3Parser}

__all__ = ["PARSERS", "CannotForce", "DeepSeekV3Parser", "HermesParser", "Llama3JsonParser", "MistralParser", "PythonicParser",
           "Qwen3CoderParser", "ToolCallParser", "get_parser", "strip_reasoning"]


def get_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"Unknown tool_parser '{name}'. Known parsers: {', '.join(PARSERS)}, or 'auto'.")
    return PARSERS[name]()
