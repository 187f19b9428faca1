"""A number-guessing user: it holds a secret number and answers each guess with higher or lower."""

from __future__ import annotations

import re
from typing import Any

from turnrl.env.interactions import Reply, last_assistant_text

INT = re.compile(r"-?\d+")


class GuessNumberUser:
    """Final reward 1 when the secret is found, minus `step_penalty` per extra guess (floored at 0.1)."""

    def __init__(self, step_penalty: float = 0.1):
        self.step_penalty = step_penalty
        self.secret = 0
        self.low, self.high = 1, 100
        self.guesses = 0
        self.found = False

    def start(self, secret: int | None = None, low: int = 1, high: int = 100, **kwargs: Any) -> None:
        if secret is None:
            raise ValueError("guess_number needs interaction kwargs {secret: N}")
        self.secret, self.low, self.high = int(secret), int(low), int(high)
        self.guesses, self.found = 0, False

    def respond(self, messages: list[dict[str, Any]]) -> Reply:
        numbers = INT.findall(last_assistant_text(messages))
        if not numbers:
            return Reply(f"Please guess a whole number between {self.low} and {self.high}.")
        guess = int(numbers[-1])
        self.guesses += 1
        if guess == self.secret:
            self.found = True
            return Reply("Correct! You found it.", done=True, info={"guesses": self.guesses})
        return Reply("Higher." if guess < self.secret else "Lower.", info={"guesses": self.guesses})

    def finish(self) -> float:
        if not self.found:
            return 0.0
        return max(0.1, 1.0 - self.step_penalty * (self.guesses - 1))
