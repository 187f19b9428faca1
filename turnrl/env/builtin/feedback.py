"""A rule-based user that checks a math answer and asks for another try when it is wrong."""

from __future__ import annotations

from typing import Any

from turnrl.env.interactions import Reply, last_assistant_text
from turnrl.rewards.answers import as_number, extract_answer


class MathFeedback:
    """Reward 1 for a correct final answer; with `partial_credit`, a wrong number earns
    max(0, 1 - |error| / |truth|) * partial_credit so that near misses still carry signal."""

    def __init__(self, max_attempts: int = 3, partial_credit: float = 0.0):
        self.max_attempts = max_attempts
        self.partial_credit = partial_credit
        self.truth = None
        self.attempts = 0
        self.best = 0.0

    def start(self, ground_truth: Any = None, max_attempts: int | None = None, **kwargs: Any) -> None:
        """`max_attempts` from the row overrides the configured one."""
        self.truth = as_number(None if ground_truth is None else str(ground_truth))
        if self.truth is None:
            raise ValueError(f"math_feedback needs a numeric ground_truth, got {ground_truth!r}")
        if max_attempts is not None:
            self.max_attempts = int(max_attempts)
        self.attempts, self.best = 0, 0.0

    def _score(self, answer: str | None) -> float:
        value = as_number(answer)
        if value is None:
            return 0.0
        if value == self.truth:
            return 1.0
        scale = abs(self.truth) if self.truth != 0 else 1
        return self.partial_credit * max(0.0, 1.0 - float(abs(value - self.truth) / scale))

    def respond(self, messages: list[dict[str, Any]]) -> Reply:
        self.attempts += 1
        answer = extract_answer(last_assistant_text(messages))
        score = self._score(answer)
        self.best = max(self.best, score)
        if score == 1.0:
            return Reply("Correct, thank you!", done=True, info={"attempts": self.attempts})
        if self.attempts >= self.max_attempts:
            return Reply("That is still not right. Let's stop here.", done=True, info={"attempts": self.attempts})
        if answer is None:
            return Reply("I don't see a number in your answer. What is the final result?")
        return Reply(f"{answer} is not correct. Please check each step and tell me the final number.")

    def finish(self) -> float:
        return self.best
