"""Published chat templates of other model families (tests/chat/templates/*.jinja, each headed by its source and
license), put on copies of SmolLM2's tokenizer with the family's special tokens, and an assistant tool call
each one renders in its own format. transformers renders them (`apply_chat_template`), as for a real model.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.chat.detect import after_prompt

TEMPLATES = Path(__file__).parent / "templates"


@dataclass(frozen=True)
class Family:
    template: str                            # file name in tests/chat/templates
    parser: str                              # the rollout.tool_parser that reads its calls
    calls: list[tuple[str, dict[str, Any]]]  # what the assistant calls, as the parser should read it back
    special: tuple[str, ...] = ()
    bos: str | None = None
    eos: str | None = None
    string_arguments: bool = False           # the template concatenates `arguments`: pass a JSON string
    ids: tuple[str, ...] = ()                # tool call ids the template insists on
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


LLAMA3 = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>")
FAMILIES: dict[str, Family] = {
    "qwen3_coder": Family("qwen3_coder.jinja", "qwen3_coder", [
        ("get_weather", {"city": "São Paulo", "days": 3, "units": {"temp": "C"}, "hours": [6, 12]}),
        ("write_file", {"path": "a.py", "text": "def f():\n    return 'x < y'\n"})]),
    "qwen3": Family("qwen3.jinja", "hermes", [
        ("get_weather", {"city": "Paris", "days": 2}), ("search", {"query": "<b>bold</b> \"quoted\""})]),
    "qwen3_5": Family("qwen3_5.jinja", "qwen3_coder", [
        ("get_weather", {"city": "Paris", "days": 2}), ("search", {"query": "RL for LLMs"})]),
    "mistral": Family("mistral.jinja", "mistral", [
        ("get_weather", {"city": "Oslo", "days": 2}), ("search", {"query": "say \"hi\""})],
        special=("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                 "[/TOOL_RESULTS]"), bos="<s>", eos="</s>", ids=("a1b2c3d4e", "f5g6h7i8j")),
    "deepseek_v3": Family("deepseek_v3.jinja", "deepseek_v3", [
        ("get_weather", {"city": "Lima", "days": 1}), ("search", {"query": "```code``` fences"})],
        special=("<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                 "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                 "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", string_arguments=True),
    # vLLM's Llama 3.2 template writes values with '%s' unquoted: strings would come out as bare names, so this
    # round trip uses the values it writes as Python literals.
    "llama3_2_pythonic": Family("llama3_2_pythonic.jinja", "pythonic", [
        ("get_forecast", {"days": 3, "ratio": 0.5, "hours": [6, 12], "metric": True}), ("now", {})],
        special=LLAMA3, bos="<|begin_of_text|>", eos="<|eot_id|>"),
    # vLLM's Llama 4 template quotes every value: strings round-trip (numbers would come back as strings).
    "llama4_pythonic": Family("llama4_pythonic.jinja", "pythonic", [
        ("get_weather", {"city": "New York", "unit": "C"}), ("search", {"query": "tool calls"})],
        special=("<|header_start|>", "<|header_end|>", "<|eot|>", "<|eom|>"), bos="<|begin_of_text|>", eos="<|eot|>"),
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


def template_text(family: Family) -> str:
    return (TEMPLATES / family.template).read_text()


def family_tokenizer(base: Any, family: Family) -> Any:
    tok = copy.deepcopy(base)
    specials: dict[str, Any] = {"additional_special_tokens": list(family.special)} if family.special else {}
    if family.bos:
        specials["bos_token"] = family.bos
    if family.eos:
        specials["eos_token"] = family.eos
    if specials:
        tok.add_special_tokens(specials)
    tok.chat_template = template_text(family)
    return tok


def assistant_with_calls(family: Family, content: str = "") -> dict[str, Any]:
    calls = []
    for k, (name, args) in enumerate(family.calls):
        call = {"type": "function", "function": {"name": name,
                                                 "arguments": json.dumps(args) if family.string_arguments else args}}
        call["id"] = family.ids[k] if family.ids else f"call{k:05d}"
        calls.append(call)
    return {"role": "assistant", "content": content, "tool_calls": calls}


def rendered_assistant_text(tokenizer: Any, family: Family) -> str:
    """What the template writes for the assistant's tool-call message: the render with it, minus the render
    up to the generation prompt (the text a model trained on this template samples)."""
    user = [{"role": "user", "content": "What is the weather?"}]
    prompt = tokenizer.apply_chat_template(user, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(user + [assistant_with_calls(family)], tools=[WEATHER], tokenize=False)
    return after_prompt(prompt, full)
