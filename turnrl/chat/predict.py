"""A guess at the text a chat template appends for new messages, without rendering the conversation.

`DeltaSkeleton` is the template's delta for a shape of new messages (their roles and fields), rendered once
after a fixed two-message anchor with a sentinel in place of every string field; `fill` puts the real values
back. For an append-only template whose fields render verbatim (ChatML, hermes) the filled text is exactly
what a full render adds; where it is not (a template that trims content, moves tools next to the last user
message, numbers turns), the guess is wrong. A guess is only ever a guess: the gateway samples from it early
and checks it against the ledger built the usual way (`ChatSession.add_environment`, full render and all)
before it uses the sample; a wrong guess is thrown away and its shape is not guessed again (`forget`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from turnrl.chat.templates import ChatTemplate

MAX_SHAPES = 4096
ANCHOR = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]


def _sentinel(k: int) -> str:
    return f"TURNRLFIELD{k}QX"


@dataclass(frozen=True)
class DeltaSkeleton:
    parts: tuple[str | int, ...]   # text, or the index of a field value

    def fill(self, values: list[str]) -> str:
        return "".join(values[p] if isinstance(p, int) else p for p in self.parts)


def shape(messages: list[dict[str, Any]]) -> tuple[Any, ...] | None:
    """The messages' roles and field names; None if a field is not a string (not guessed)."""
    out = []
    for m in messages:
        if not all(isinstance(v, str) for v in m.values()):
            return None
        out.append(tuple(m))
    return tuple(out)


def values(messages: list[dict[str, Any]]) -> list[str]:
    return [v for m in messages for k, v in m.items() if k != "role"]


def _skeleton(template: ChatTemplate, tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]]
              ) -> DeltaSkeleton | None:
    k = 0
    probe = []
    for m in messages:
        copy = {}
        for key, value in m.items():
            if key == "role":
                copy[key] = value
            else:
                copy[key] = _sentinel(k)
                k += 1
        probe.append(copy)
    try:
        base = template.render(ANCHOR, tools)
        full = template.render(ANCHOR + probe, tools, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that refuses the probe: no guess, the usual path decides
        return None
    if not full.startswith(base):
        return None
    delta, parts = full[len(base):], []
    while delta:
        hits = [(delta.find(_sentinel(j)), j) for j in range(k) if _sentinel(j) in delta]
        if not hits:
            parts.append(delta)
            break
        at, j = min(hits)
        if at:
            parts.append(delta[:at])
        parts.append(j)
        delta = delta[at + len(_sentinel(j)):]
    return DeltaSkeleton(tuple(parts))


class Guesses:
    """Skeletons per (tools, shape) for one template; a shape that guessed wrong once is not guessed again."""

    def __init__(self, template: ChatTemplate):
        self.template = template
        self.known: dict[tuple[str, Any], DeltaSkeleton | None] = {}

    @staticmethod
    def tools_key(tools: list[dict[str, Any]] | None) -> str:
        return json.dumps(tools, sort_keys=True, default=str) if tools else ""

    def delta(self, tools_key: str, tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]]) -> str | None:
        s = shape(messages)
        if s is None:
            return None
        key = (tools_key, s)
        if key not in self.known:
            if len(self.known) >= MAX_SHAPES:   # many tool sets or shapes: start over rather than grow
                self.known.clear()
            self.known[key] = _skeleton(self.template, tools, messages)
        skeleton = self.known[key]
        return None if skeleton is None else skeleton.fill(values(messages))

    def forget(self, tools_key: str, messages: list[dict[str, Any]]) -> None:
        s = shape(messages)
        if s is not None:
            self.known[(tools_key, s)] = None
