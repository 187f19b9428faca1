"""An answer-checker tool for generated math tasks: the policy submits, the tool says right or wrong.

State persists across calls within a trajectory: the reward is 1 if any submission was correct, and the
number of submissions is reported.
"""

from __future__ import annotations

from typing import Any

from turnrl.env.tools import ToolOutput
from turnrl.rewards.answers import same_number


class AnswerChecker:
    name = "check_answer"
    schema = {"type": "function", "function": {
        "name": "check_answer",
        "description": "Submit your final numeric answer; says whether it is correct.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "number"}}, "required": ["answer"]}}}

    def __init__(self, max_submissions: int = 3):
        self.max_submissions = max_submissions
        self.ground_truth: Any = None
        self.submissions = 0
        self.solved = False

    def create(self, ground_truth: Any = None, **kwargs: Any) -> None:
        if ground_truth is None:
            raise ValueError("check_answer needs create kwargs {ground_truth: ...} from the row")
        self.ground_truth, self.submissions, self.solved = ground_truth, 0, False

    def execute(self, args: dict[str, Any]) -> ToolOutput:
        if self.submissions >= self.max_submissions:
            return ToolOutput("No submissions left.", metrics={"submissions": self.submissions})
        self.submissions += 1
        ok = same_number(args.get("answer"), self.ground_truth)
        self.solved = self.solved or ok
        return ToolOutput("Correct." if ok else "Incorrect.", metrics={"submissions": self.submissions})

    def reward(self) -> float:
        return 1.0 if self.solved else 0.0

    def release(self) -> None:
        self.ground_truth = None
