"""Template parity checks: does building a conversation by token deltas give what a full render gives?

`check_conversation` replays a finished conversation through `ChatSession` as if the policy had sampled
each assistant message (its canonical tokens plus the end-of-turn token), appends the other messages as
deltas, and compares the ledger with the tokenized full render. `turnrl check-template MODEL` runs it on
`SYNTHETIC` conversations: tools, several turns, parallel calls, empty and unicode content, reasoning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from turnrl.chat.session import ChatMismatchError, ChatSession
from turnrl.chat.templates import ChatTemplate
from turnrl.ledger import Trajectory

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _call(name: str, **args: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


SYNTHETIC: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {
    "multi_turn": ([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "You're welcome."}], []),
    "tool_call": ([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": _call("get_weather", city="Paris")},
        {"role": "tool", "name": "get_weather", "content": "{\"temp_c\": 18, \"sky\": \"clear\"}"},
        {"role": "assistant", "content": "It is 18 °C and clear in Paris."}], [WEATHER]),
    "parallel_calls": ([
        {"role": "user", "content": "Weather in Oslo and Lima?"},
        {"role": "assistant", "content": _call("get_weather", city="Oslo") + "\n" + _call("get_weather", city="Lima")},
        {"role": "tool", "name": "get_weather", "content": "{\"temp_c\": -3}"},
        {"role": "tool", "name": "get_weather", "content": "{\"temp_c\": 21}"},
        {"role": "assistant", "content": "Oslo -3 °C, Lima 21 °C."},
        {"role": "user", "content": "And Rome?"},
        {"role": "assistant", "content": _call("get_weather", city="Rome")},
        {"role": "tool", "name": "get_weather", "content": "{\"temp_c\": 25}"},
        {"role": "assistant", "content": "Rome: 25 °C."}], [WEATHER]),
    "empty_and_unicode": ([
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Übersetze: 猫 🐈 — «naïve» café\u0301 \t tab"},
        {"role": "assistant", "content": "Katze 🐈 — naïve Café\n\nzwei  Leerzeichen"}], []),
    "reasoning": ([
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "<think>\n6 * 7 = 42\n</think>\n\n42"},
        {"role": "user", "content": "And 6 * 8?"},
        {"role": "assistant", "content": "<think>\n42 + 6 = 48\n</think>\n\n48"}], []),
}


@dataclass
class ParityReport:
    name: str
    result: str                  # exact | token_drift | mismatch | split | error
    detail: str = ""


def token_diff(template: ChatTemplate, expected: list[int], actual: list[int], context: int = 6) -> str:
    i = next((k for k, (a, b) in enumerate(zip(expected, actual)) if a != b), min(len(expected), len(actual)))
    def show(ids: list[int]) -> str:
        return " ".join(f"{t}:{template.decode([t])!r}" for t in ids[max(0, i - context):i + context])
    return (f"first difference at token {i} (expected {len(expected)} tokens, ledger {len(actual)})\n"
            f"  render: {show(expected)}\n  ledger: {show(actual)}")


def check_conversation(template: ChatTemplate, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                       on_mismatch: str = "error", name: str = "") -> tuple[ParityReport, Trajectory]:
    return replay_conversation(template, messages, tools, on_mismatch, name)


def replay_conversation(template: ChatTemplate, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                        on_mismatch: str = "error", name: str = "", prompt_len: int | None = None
                        ) -> tuple[ParityReport, Trajectory]:
    """Build a ledger as if the policy had sampled each assistant message after the first `prompt_len`
    messages (default: everything before the first assistant message is the prompt)."""
    first = prompt_len if prompt_len is not None else \
        next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    traj = Trajectory(group_id=name or "parity", sample_index=0, messages=[])
    stop = template.stop_token_ids[0]
    try:
        session = ChatSession(template, messages[:first], tools, traj, on_mismatch)
        i, turn = first, 0
        while i < len(messages):
            ids = template.encode(template.join_reasoning(messages[i])["content"]) + [stop]
            session.add_assistant(ids, [0.0] * len(ids), "stop", turn)
            j = i + 1
            while j < len(messages) and messages[j]["role"] != "assistant":
                j += 1
            if j > i + 1:
                session.add_environment([dict(m) for m in messages[i + 1:j]], turn)
            i, turn = j, turn + 1
        result = session.finish()
    except ChatMismatchError as exc:
        return ParityReport(name, "mismatch", str(exc)), traj
    except Exception as exc:  # noqa: BLE001 - a template that raises on this conversation (e.g. Mistral's id checks)
        return ParityReport(name, "error", f"the template cannot render this conversation: "
                                           f"{type(exc).__name__}: {exc}"), traj
    detail = ""
    if result != "exact":
        expected = template.encode(template.render(traj.messages, session.render_tools))
        detail = token_diff(template, expected, traj.segment.token_ids)
    return ParityReport(name, traj.parity if traj.parity == "split" else result, detail), traj


def check_template(template: ChatTemplate, on_mismatch: str = "error") -> list[ParityReport]:
    return [check_conversation(template, msgs, tools, on_mismatch, name)[0]
            for name, (msgs, tools) in SYNTHETIC.items()]
