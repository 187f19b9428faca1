"""Steps that trained on nothing: loud, and the run stops when it keeps happening.

When every trajectory of a step is masked (a judge down, rows naming an unknown tool, a context too small to
generate in), no reward was measured: the step's metrics carry no `reward/*` (never a made-up 0.0), a warning
names the step and its error counts, and after `trainer.max_masked_steps` such steps in a row the run stops
with `AllMaskedError` (the CLI prints it and exits 1) instead of spending its budget on zero gradients.
A step with at least one scored trajectory resets the count.
"""

from __future__ import annotations

import sys
from typing import Any


class AllMaskedError(RuntimeError):
    """Too many steps in a row had no scored trajectory."""


def nothing_scored(metrics: dict[str, Any]) -> bool:
    return metrics.get("trajectories", 0) > 0 and metrics.get("masked", 0) >= metrics["trajectories"]


class MaskedSteps:
    def __init__(self, limit: int):
        self.limit = limit   # 0: warn, never stop
        self.in_a_row = 0

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        """After step `step` was logged: warn when nothing was scored; AllMaskedError past the limit."""
        if not nothing_scored(metrics):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        errors = ", ".join(f"{k[len('errors/'):]}: {v:g}" for k, v in sorted(metrics.items())
                           if k.startswith("errors/") and v) or "none recorded"
        print(f"[turnrl] WARNING: step {step}: all {metrics['trajectories']} trajectories were masked out "
              f"(errors: {errors}); no reward was measured and the policy learned nothing from this step. "
              f"See the errors in trajectories.jsonl (turnrl view).", file=sys.stderr, flush=True)
        if self.limit and self.in_a_row >= self.limit:
            raise AllMaskedError(
                f"{self.in_a_row} steps in a row (up to step {step}) had every trajectory masked out "
                f"(errors: {errors}): stopping instead of training on nothing. Fix the environment (tools, judge "
                f"or simulated-user endpoint, data rows, rollout.max_context_tokens), then resume with "
                f"trainer.resume=latest; trainer.max_masked_steps sets the limit (0: never stop).")
