"""The LLM judge: a rubric prompt with the conversation rendered in, and validated JSON scores out.

The judge sees the conversation as plain text (`USER:` / `ASSISTANT:` blocks; the system prompt and template
glue left out; a conversation longer than `max_chars` loses its middle), the row's task, the user's hidden
goal and the reference answer when the row has them, and one line per metric. It must answer with one JSON
object holding a number in [0, 1] for every metric. Parsing takes the first JSON object anywhere in the
reply (prose or code fences around it are fine), accepts numeric strings, and rejects missing metrics,
non-numbers and values out of range. A reply that fails is answered with what was wrong and asked again
(`parse_retries` times; the re-ask is a new prompt, so it is not served from the cache). `json_prefill`
starts the reply with `{"<first metric>": ` so that small models stay in the format.

A judge that cannot give valid scores (the endpoint failed after its retries, or every reply was malformed)
raises `JudgeError`, which the reward stage records as a `judge` error that masks the sample: never a zero.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.config.loader import ConfigError
from turnrl.config.schema import COMPUTED_METRICS, JUDGED_METRICS  # noqa: F401 (the judge's metric tables)
from turnrl.llm.client import ChatResult, LLMClient, LLMError, Usage, json_objects

SYSTEM = ("You are an impartial evaluator. You read a conversation between a user and an AI assistant and rate "
          "the assistant. You answer with one JSON object and nothing else.")

RUBRIC = """Rate the assistant in the conversation below.
{context}
<conversation>
{conversation}
</conversation>

Metrics, each a number from 0 to 1:
{metrics}

Answer with only a JSON object with exactly these keys, in this format: {example}"""

PLACEHOLDER = re.compile(r"\{(conversation|metrics|example|context|task|goal|ground_truth)\}")
ROLE_NAMES = {"user": "USER", "assistant": "ASSISTANT", "tool": "TOOL"}


class JudgeError(RuntimeError):
    """No valid scores could be had; `usage` and `parse_failures` say what it cost."""

    def __init__(self, message: str, usage: Usage, parse_failures: int):
        super().__init__(message)
        self.usage = usage
        self.parse_failures = parse_failures


class ScoreParseError(ValueError):
    pass


@dataclass
class Verdict:
    scores: dict[str, float]
    usage: Usage = field(default_factory=Usage)
    parse_failures: int = 0


def load_rubric(spec: str | None) -> str:
    """The built-in rubric, or a template file that must contain `{conversation}`."""
    if spec is None:
        return RUBRIC
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"judge rubric file '{spec}' does not exist.")
    text = path.read_text()
    if "{conversation}" not in text:
        raise ConfigError(f"judge rubric '{spec}' has no {{conversation}} placeholder: the judge would not see "
                          "the conversation. Placeholders: {conversation} {metrics} {example} {context} {task} "
                          "{goal} {ground_truth}.")
    return text


def render_conversation(messages: list[dict[str, Any]], max_chars: int) -> str:
    blocks = [f"{ROLE_NAMES[m['role']]}: {str(m.get('content') or '').strip()}" for m in messages
              if m.get("role") in ROLE_NAMES]
    text = "\n\n".join(blocks)
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n\n[... {len(text) - 2 * half} characters left out ...]\n\n{text[-half:]}"


def row_context(info: dict[str, Any]) -> dict[str, str]:
    """The task, the user's hidden goal and the reference answer, from the row (interaction kwargs)."""
    interaction = info.get("interaction") or {}
    truth = info.get("ground_truth")
    return {"task": str(interaction.get("task") or ""), "goal": str(interaction.get("goal") or ""),
            "ground_truth": "" if truth is None else str(truth)}


def parse_scores(text: str, metrics: list[str]) -> dict[str, float]:
    """The scores in the first JSON object of `text`; ScoreParseError says what is wrong."""
    obj = next(json_objects(text), None)
    if obj is None:
        raise ScoreParseError("no JSON object found")
    missing = [m for m in metrics if m not in obj]
    if missing:
        raise ScoreParseError(f"missing key(s) {missing} in {json.dumps(obj)[:200]}")
    scores = {}
    for m in metrics:
        value = obj[m]
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                raise ScoreParseError(f"'{m}' is {value!r}, not a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ScoreParseError(f"'{m}' is {value!r}, not a number")
        if not 0.0 <= float(value) <= 1.0:
            raise ScoreParseError(f"'{m}' is {value}, outside [0, 1]")
        scores[m] = float(value)
    return scores


def _count(usage: Usage, result: ChatResult) -> None:
    usage.requests += 1
    usage.cache_hits += result.cached
    usage.retries += max(result.attempts - 1, 0)
    if not result.cached:  # an answer from the cache cost nothing
        usage.prompt_tokens += result.prompt_tokens
        usage.completion_tokens += result.completion_tokens
    usage.seconds += result.seconds


class Judge:
    def __init__(self, client: LLMClient, metrics: dict[str, str], rubric: str = RUBRIC, json_prefill: bool = False,
                 parse_retries: int = 1, max_chars: int = 12000):
        if not metrics:
            raise ValueError("a judge needs at least one metric")
        self.client = client
        self.metrics = metrics
        self.rubric = rubric
        self.json_prefill = json_prefill
        self.parse_retries = parse_retries
        self.max_chars = max_chars
        # A format, not numbers: small judges copy an example's numbers whatever the conversation.
        self.example = "{" + ", ".join(f'"{m}": <0 to 1>' for m in metrics) + "}"

    def prompt(self, messages: list[dict[str, Any]], info: dict[str, Any]) -> list[dict[str, Any]]:
        ctx = row_context(info)
        lines = [f"The user's task: {ctx['task']}" if ctx["task"] else "",
                 f"What the user really wanted (hidden from the assistant): {ctx['goal']}" if ctx["goal"] else "",
                 f"Reference answer: {ctx['ground_truth']}" if ctx["ground_truth"] else ""]
        values = {**ctx, "conversation": render_conversation(messages, self.max_chars),
                  "metrics": "\n".join(f"- {name}: {text}" for name, text in self.metrics.items()),
                  "example": self.example, "context": "\n".join(x for x in lines if x)}
        text = PLACEHOLDER.sub(lambda m: values[m.group(1)], self.rubric)
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]

    async def score(self, messages: list[dict[str, Any]], info: dict[str, Any]) -> Verdict:
        """Scores for one conversation; raises JudgeError when none can be had."""
        usage = Usage()
        prompt = self.prompt(messages, info)
        prefill = f'{{"{next(iter(self.metrics))}": ' if self.json_prefill else ""
        failures = 0
        reason = ""
        for _ in range(self.parse_retries + 1):
            try:
                result = await self.client.chat(prompt, prefill=prefill)
            except LLMError as exc:
                usage.errors += 1
                raise JudgeError(str(exc), usage, failures) from None
            _count(usage, result)
            reply = prefill + result.text
            try:
                return Verdict(parse_scores(reply, list(self.metrics)), usage, failures)
            except ScoreParseError as exc:
                failures += 1
                reason = f"{exc}; reply: {reply[:160]!r}"
                prompt = prompt + [{"role": "assistant", "content": reply},
                                   {"role": "user", "content": f"That answer is not valid ({exc}). Reply with only "
                                                               f"the JSON object, in this format: {self.example}"}]
        raise JudgeError(f"no valid scores after {failures} repl{'y' if failures == 1 else 'ies'}: {reason}",
                         usage, failures)
