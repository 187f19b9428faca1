"""Which tool-call parser reads what a chat template writes (`rollout.tool_parser: auto`).

The template renders an assistant message holding one probe call in `tool_calls` (the OpenAI shape a client
sends back), and every parser reads the text that follows the generation prompt: the parser that returns
exactly the probe call, name and arguments, is the template's format. The probe's one argument is a number,
since some published templates write string values unquoted (vLLM's Llama 3.2 pythonic one) and others quote
every value (its Llama 4 one): a number reads back from both. Arguments go in as an object, or as a JSON string
for templates that concatenate them (DeepSeek-V3's). A template that writes no call and renders no tools at all
(SmolLM2's) gets turnrl's injected hermes prompt (`ChatTemplate.prepare`), so its format is hermes. Anything
else, a template that renders tools but drops assistant `tool_calls` or writes them in a format no parser
reads, cannot be detected, and `parser_for` says so instead of guessing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from turnrl.chat.parsers import PARSERS, ToolCallParser, get_parser
from turnrl.chat.templates import ChatTemplate, TemplateError

# Most specific first: a format whose markup another parser might half-read comes before that parser.
ORDER = ("qwen3_coder", "hermes", "mistral", "deepseek_v3", "pythonic", "llama3_json")
PROBE_NAME = "probe_tool_zq"
PROBE_ARGS = {"count": 7}
PROBE = {"type": "function", "function": {"name": PROBE_NAME, "description": "probe", "parameters": {
    "type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}}}
PROBE_ID = "probe0001"  # nine letters and digits: Mistral's template insists


@dataclass(frozen=True)
class Detection:
    parser: str | None       # a PARSERS name, or None: cannot tell
    reason: str


def detect_parser(template: ChatTemplate) -> Detection:
    text = probe_text(template)
    if text is not None:
        for name in ORDER:
            if _reads(PARSERS[name](), text):
                note = "" if template.native_tools else (
                    "; it renders no tools= list, so turnrl injects its tool prompt, whose example is hermes: "
                    "show this format in the task's system prompt too")
                return Detection(name, f"the template writes tool calls as {name}: {text.strip()[:120]!r}{note}")
    if not template.native_tools:
        return Detection("hermes", "the template renders no tools, so turnrl injects its hermes tool prompt")
    if text is None:
        return Detection(None, "the template renders tools but fails on, or drops, an assistant message's tool_calls")
    return Detection(None, f"the template writes a tool call as {text.strip()[:160]!r}, which no parser reads")


def parser_for(name: str, template: ChatTemplate) -> ToolCallParser:
    """`rollout.tool_parser`: a parser name, or `auto` to detect it from the template."""
    if name != "auto":
        return get_parser(name)
    found = detect_parser(template)
    if found.parser is None:
        raise TemplateError(f"rollout.tool_parser=auto cannot tell the tool-call format: {found.reason}. Set "
                            f"rollout.tool_parser to one of {', '.join(PARSERS)}.")
    return get_parser(found.parser)


def probe_text(template: ChatTemplate) -> str | None:
    """The text a template writes for an assistant message with the probe call (None: it writes none)."""
    user = [{"role": "user", "content": "hi"}]
    try:
        prompt = template.render(user, [PROBE], add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that cannot render tools has no format to detect
        return None
    for arguments in (PROBE_ARGS, json.dumps(PROBE_ARGS)):
        message = {"role": "assistant", "content": "", "tool_calls": [
            {"id": PROBE_ID, "type": "function", "function": {"name": PROBE_NAME, "arguments": arguments}}]}
        try:
            full = template.render(user + [message], [PROBE])
        except Exception:  # noqa: BLE001 - e.g. DeepSeek-V3's template cannot concatenate an object
            continue
        text = after_prompt(prompt, full)
        # What a model samples ends before its end-of-turn token.
        for stop in (template.decode([i]) for i in template.stop_token_ids):
            text = text.split(stop, 1)[0] if stop else text
        if PROBE_NAME in text:
            return text
    return None


def after_prompt(prompt: str, full: str) -> str:
    """`full` past what it shares with `prompt`, not cutting a special token in two (a prompt may end with text,
    e.g. `<think>`, that the full render does not have)."""
    common = 0
    while common < min(len(prompt), len(full)) and prompt[common] == full[common]:
        common += 1
    if full.rfind("<", 0, common) > full.rfind(">", 0, common):
        common = full.rfind("<", 0, common)
    return full[common:]


def _reads(parser: ToolCallParser, text: str) -> bool:
    calls = parser.parse(text)
    return (len(calls) == 1 and calls[0].error is None and calls[0].name == PROBE_NAME
            and _loose(calls[0].arguments) == _loose(PROBE_ARGS))


def _loose(args: dict[str, Any] | None) -> dict[str, str]:
    return {k: str(v) for k, v in (args or {}).items()}
