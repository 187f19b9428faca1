"""A sampled completion -> the OpenAI assistant message the agent receives, and how to recognise it later.

The model's text goes through the configured tool parser (hermes, llama3_json): well-formed calls become
`tool_calls` (ids `call_<random>`, arguments as JSON text) and leave the content; malformed ones stay in the
content, so the agent sees what the model wrote, and are counted as the policy's tool-parse errors.
`finish_reason` is `tool_calls` when calls were returned, else `stop` or `length` as the engine ended.

Stop strings: the engines stop on token ids only, so a completion is cut after the first token whose text
completes a stop string; the ledger keeps the sampled tokens up to that one (the policy was conditioned on
them next turn) and the content ends before the stop string, as OpenAI's does.

Forced openings (`tool_choice: required` or a named function): the gateway puts the parser's call opening
ahead of the reply (`forced_ids`, in the ledger as template tokens). The text the agent receives, and the
parser reads, is that opening plus the sampled text, as if the model had written both; `token_ids` and
`logprobs` stay the sampled tokens only, and stop strings are looked for in the sampled text.

A `Reply` remembers what the agent was sent. When an assistant message comes back in a later request,
`Reply.matches` accepts it if the tool calls are the same (name and arguments compared as parsed JSON:
other whitespace, key order or call ids are fine) and the text is the same up to surrounding whitespace and
`<think>` reasoning (or is empty, when the framework drops text next to tool calls).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from turnrl.chat.parsers import ToolCallParser, strip_reasoning
from turnrl.chat.templates import ChatTemplate
from turnrl.gateway.requests import Message, canonical_arguments
from turnrl.ledger import ToolCall


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass
class Reply:
    token_ids: list[int]                 # what goes into the ledger (stop-string cut applied)
    logprobs: list[float]
    finish_reason: str                   # engine's: stop | length | abort
    text: str                            # the decoded completion without the end-of-turn token
    content: str | None                  # what the agent is sent
    calls: list[ToolCall] = field(default_factory=list)        # parsed calls sent as tool_calls
    call_ids: list[str] = field(default_factory=list)
    bad_calls: list[ToolCall] = field(default_factory=list)    # malformed calls left in the content
    forced_ids: list[int] = field(default_factory=list)        # the forced opening the reply continues (not sampled)

    @property
    def openai_finish(self) -> str:
        if self.calls:
            return "tool_calls"
        return "length" if self.finish_reason == "length" else "stop"

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            msg["tool_calls"] = [
                {"id": cid, "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                for cid, c in zip(self.call_ids, self.calls)]
        return msg

    def matches(self, sent: Message) -> bool:
        if sent.role != "assistant":
            return False
        mine = [(c.name, canonical_arguments(c.arguments)) for c in self.calls]
        if [c[1:] for c in sent.tool_calls] != mine:
            return False
        theirs = strip_reasoning(sent.content).strip()
        return theirs == strip_reasoning(self.content or "").strip() or (not theirs and bool(mine))


def cut_at_stop(template: ChatTemplate, ids: list[int], logprobs: list[float], stops: list[str]
                ) -> tuple[list[int], list[float], str | None]:
    """(ids, logprobs, content) cut after the token that completes the first stop string; content None if none."""
    if not stops:
        return ids, logprobs, None
    text = template.decode(ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return ids, logprobs, None
    at, stop = min(hits)
    end = at + len(stop)
    for k in range(1, len(ids) + 1):   # the first prefix whose text reaches past the stop string
        if len(template.decode(ids[:k])) >= end:
            return ids[:k], logprobs[:k], text[:at]
    return ids, logprobs, text[:at]


def build_reply(template: ChatTemplate, parser: ToolCallParser | None, ids: list[int], logprobs: list[float],
                finish_reason: str, stops: list[str], forced_ids: list[int] | tuple[int, ...] = ()) -> Reply:
    """`parser` None: tools are off for this request (no tools, or tool_choice 'none'). `forced_ids`: the
    opening the engine continued from, which starts the reply's text."""
    forced = list(forced_ids)
    ids, logprobs, cut = cut_at_stop(template, list(ids), list(logprobs), stops)
    if cut is not None:
        finish_reason = "stop"
        text = template.decode(forced) + cut if forced else cut
    else:
        body = ids[:-1] if finish_reason == "stop" and ids and ids[-1] in template.stop_token_ids else ids
        text = template.decode(forced + body)   # decoded together, as `ChatSession.add_assistant` does
    reply = Reply(ids, logprobs, finish_reason, text, text, forced_ids=forced)
    if parser is None or finish_reason != "stop":
        return reply
    calls = parser.parse(text)
    good = [c for c in calls if c.error is None]
    reply.bad_calls = [c for c in calls if c.error is not None]
    if good:
        reply.calls = good
        reply.call_ids = [new_id("call_") for _ in good]
        rest = text
        for c in good:   # hermes calls leave the text; a whole-message format (llama3_json) leaves nothing
            rest = rest.replace(c.raw, "", 1) if c.raw in rest else ""
        reply.content = rest.strip() or None
    return reply
