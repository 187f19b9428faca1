"""A simulated user played by an LLM (the CollabLLM user): it wants something and reveals it when asked.

Row kwargs: `interaction: {name: llm_user, task: "what the user asks for", goal: "what they really want,
hidden from the assistant"}`. The LLM gets a role-play system prompt with both, and sees the conversation
with the roles swapped (the policy's messages are its `user` turns, the user's own earlier messages its
`assistant` turns), so that it writes the user's next message. The reply is parsed: a JSON object with a
`response` key (CollabLLM's answer format) gives that text; otherwise the text itself, without a leading
role label or wrapping quotes. The termination marker (`[[TERMINATE CHAT]]`) anywhere in the reply ends the
conversation, and so does the `max_turns`-th reply. An empty reply or a failed LLM call (after the client's
retries) raises: the agent loop records an `interaction` error and masks the sample.

Config (the interaction spec's `config`): `llm` (an LLMConfig mapping: backend, model, ...), `max_turns`,
`prompt` (a template file with {task} {goal} {marker}), `termination_marker`. State is per trajectory (turn
count, token counts); the LLM client is shared by every instance with the same config (turnrl.llm.pool), so
the concurrency limit, cache and cost account are per endpoint. Each reply's cost is in `Reply.info`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.config.loader import ConfigError, build
from turnrl.config.schema import LLMConfig
from turnrl.env.interactions import Reply
from turnrl.llm.client import json_objects
from turnrl.llm.pool import client

PROMPT = """You are playing a user who is chatting with an AI assistant. Stay in character: you are the user, \
never the assistant.

Your request: {task}
What you really want (the assistant does not know it; reveal a detail only when the assistant asks about it or \
gets it wrong): {goal}

Rules:
- Write short, natural messages, as a person would: one to three sentences.
- Answer the assistant's questions from what you really want. Do not solve the task yourself.
- When the assistant has fully helped you, or the conversation goes nowhere, write {marker}."""

LABEL = re.compile(r"^\s*(?:\*\*)?(?:user|me|you)(?:\*\*)?\s*:\s*", re.IGNORECASE)
SWAP = {"user": "assistant", "assistant": "user"}


@dataclass
class UserConfig:
    llm: LLMConfig
    max_turns: int = 6
    prompt: str | None = None
    termination_marker: str = "[[TERMINATE CHAT]]"

    def validate(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"'max_turns' must be >= 1, got {self.max_turns}.")
        if not self.termination_marker.strip():
            raise ConfigError("'termination_marker' must not be empty.")


def parse_reply(text: str, marker: str) -> tuple[str, bool, str]:
    """(message, done, format) from the simulator's raw reply; format is `json` or `text`."""
    done = marker in text
    fmt = "text"
    found = next((o for o in json_objects(text) if isinstance(o.get("response"), str)), None)
    if found is not None:
        text, fmt = found["response"], "json"
        done = done or marker in text
    text = LABEL.sub("", text.replace(marker, "").strip()).strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1].strip()
    return text, done, fmt


class LLMUser:
    def __init__(self, **config: Any):
        self.cfg = build(UserConfig, config, prefix="llm_user config")
        template = PROMPT
        if self.cfg.prompt is not None:
            path = Path(self.cfg.prompt).expanduser()
            if not path.is_file():
                raise ConfigError(f"llm_user prompt file '{path}' does not exist.")
            template = path.read_text()
        self.template = template
        self.client = client(self.cfg.llm, "user")
        self.system = ""
        self.turns = 0

    def start(self, task: str = "", goal: str = "", **kwargs: Any) -> None:
        if not task:
            raise ValueError("llm_user needs interaction kwargs {task: what the user asks for, goal: what they "
                             "really want}")
        values = {"task": task, "goal": goal or task, "marker": self.cfg.termination_marker}
        self.system = re.sub(r"\{(task|goal|marker)\}", lambda m: values[m.group(1)], self.template)
        self.turns = 0

    async def respond(self, messages: list[dict[str, Any]]) -> Reply:
        swapped = [{"role": SWAP[m["role"]], "content": str(m.get("content") or "")} for m in messages
                   if m.get("role") in SWAP]
        result = await self.client.chat([{"role": "system", "content": self.system}, *swapped])
        self.turns += 1
        text, done, fmt = parse_reply(result.text, self.cfg.termination_marker)
        info = {"user_prompt_tokens": result.prompt_tokens, "user_completion_tokens": result.completion_tokens,
                "user_cached": result.cached, "user_format": fmt}
        if not text and not done:
            raise ValueError(f"the simulated user's reply is empty (raw: {result.text[:120]!r})")
        return Reply(text, done or self.turns >= self.cfg.max_turns, 0.0, info)

    def finish(self) -> None:
        return None
