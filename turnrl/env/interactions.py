"""Interactions: simulated users and environments that answer the policy's turns.

Protocol (sync or async methods): `start(**row_kwargs)` once per trajectory, `respond(messages) -> Reply`
after every assistant turn without tool calls, `finish() -> final reward or None` (or {"score", **parts})
once at the end. An interaction with `takes_tool_calls = True` (an environment that runs its own tools) also
answers the turns with tool calls: the last message then carries OpenAI `tool_calls`, and the Reply's
`messages` (tool results, user turns) are appended instead of `text`. One
instance per trajectory: nothing is shared between concurrent samples. A row picks its interaction by name
(`interaction: {name: ..., ...kwargs}`); the rest of that mapping goes to `start`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class Reply:
    text: str
    done: bool = False
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None   # tool/user messages to append instead of a user `text`
    errors: list[str] = field(default_factory=list)  # environment failures behind this reply (masked)


@runtime_checkable
class Interaction(Protocol):
    def start(self, **kwargs: Any) -> Any: ...
    def respond(self, messages: list[dict[str, Any]]) -> Any: ...
    def finish(self) -> Any: ...


def as_reply(value: Any) -> Reply:
    """Accept a Reply, a (text, done, reward, info) tuple, or a plain string."""
    if isinstance(value, Reply):
        return value
    if isinstance(value, str):
        return Reply(value)
    if isinstance(value, tuple) and 1 <= len(value) <= 4:
        text, done, reward, info = (list(value) + [False, 0.0, {}])[:4]
        if isinstance(text, bool) and isinstance(done, str):
            raise TypeError("respond() returned verl's (terminate, text, score, extra) order; a turnrl interaction "
                            "returns (text, done, reward, info) (or write a verl class with generate_response)")
        if not isinstance(text, str):
            raise TypeError(f"respond()'s reply text must be a string, got {type(text).__name__}")
        return Reply(text, bool(done), float(reward or 0.0), dict(info or {}))
    raise TypeError(f"an interaction's respond() must return Reply, a (text, done, reward, info) tuple or a "
                    f"string; got {type(value).__name__}")


def last_assistant_text(messages: list[dict[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "assistant":
            return str(m.get("content") or "")
    return ""
