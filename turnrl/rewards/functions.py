"""Reward functions: built-ins by name, or user callables loaded from `path.py:function` / `module:function`.

A reward function receives the finished `Trajectory` and returns a float, or a dict with a `score` and extra
metrics. Functions written for verl (`compute_score(data_source, solution_str, ground_truth, extra_info)`)
are recognised by their parameter names and called that way, with `solution_str` = the last assistant
message. Sync or async. A function that raises or returns something else is recorded as a reward error on
that trajectory (masked out of the loss), never a silent zero; one that raises `RewardError` names the
error's kind itself (e.g. `judge`) and keeps what the attempt cost. A reward that samples from the policy (the
LLM judge's CollabLLM futures) gets it at construction (`turnrl.rewards.build`).
`reward.function_kwargs` gives a function fixed keyword arguments (verl's `custom_reward_function.reward_kwargs`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from turnrl.config.loader import ConfigError
from turnrl.env.interactions import last_assistant_text
from turnrl.env.loading import import_object
from turnrl.ledger import Trajectory
from turnrl.rewards.answers import extract_answer, same_number


def final_text(traj: Trajectory) -> str:
    return last_assistant_text(traj.messages)


def exact_answer(traj: Trajectory) -> float:
    """1 when the last assistant message's `#### N` (or \\boxed{N}) equals the ground truth."""
    return 1.0 if same_number(extract_answer(final_text(traj), strict=True), traj.info.get("ground_truth")) else 0.0


def last_number(traj: Trajectory) -> float:
    """1 when the last number in the last assistant message equals the ground truth (lenient)."""
    return 1.0 if same_number(extract_answer(final_text(traj)), traj.info.get("ground_truth")) else 0.0


def answer_format(traj: Trajectory) -> float:
    """1 when the last assistant message states its answer as `#### N`."""
    return 1.0 if extract_answer(final_text(traj), strict=True) is not None else 0.0


def tool_success(traj: Trajectory) -> float:
    """1 when at least one tool call ran without error."""
    return 1.0 if any(r.error is None for t in traj.turns for r in t.tool_results) else 0.0


def math_equiv(traj: Trajectory) -> float:
    """1 when the last assistant message's final answer equals the ground truth mathematically (math-verify:
    `\\boxed{}`, LaTeX, fractions, expressions; `pip install math-verify`)."""
    from math_verify import parse, verify
    truth = traj.info.get("ground_truth")
    if truth is None:
        raise ValueError("math_equiv needs the row's ground_truth")
    gold = parse(str(truth)) or parse(f"${truth}$")  # bare LaTeX such as x^2+1 parses only inside $...$
    answer = parse(final_text(traj))
    return 1.0 if gold and answer and verify(gold, answer) else 0.0


BUILTIN: dict[str, Callable[[Trajectory], Any]] = {
    "exact_answer": exact_answer, "last_number": last_number, "answer_format": answer_format,
    "tool_success": tool_success, "math_equiv": math_equiv}
NEEDS = {"math_equiv": ("math_verify", "math-verify")}   # built-in -> (module, package that provides it)


class RewardError(RuntimeError):
    """A reward that could not be computed (a judge that failed after its retries, ...): recorded as an error of
    `kind` that masks the sample, with `metrics` (what the attempt cost) kept on the trajectory."""

    def __init__(self, kind: str, message: str, metrics: dict[str, float] | None = None):
        super().__init__(message)
        self.kind = kind
        self.metrics = dict(metrics or {})


@dataclass
class RewardFunction:
    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    verl_style: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)   # fixed keyword arguments (verl's reward_kwargs)

    async def __call__(self, traj: Trajectory) -> Any:
        if self.verl_style:
            extra = dict(traj.info.get("extra") or {})
            extra.setdefault("index", traj.info.get("index"))
            args = dict(data_source=traj.info.get("data_source", ""), solution_str=final_text(traj),
                        ground_truth=traj.info.get("ground_truth"), extra_info=extra)
            params = inspect.signature(self.fn).parameters
            if not any(p.kind == p.VAR_KEYWORD for p in params.values()):  # e.g. f(solution_str, ground_truth)
                args = {k: v for k, v in args.items() if k in params}
            result = self.fn(**args, **self.kwargs)
        else:
            result = self.fn(traj, **self.kwargs)
        return await result if inspect.isawaitable(result) else result


def load_reward_function(name: str, weight: float = 1.0, kwargs: dict[str, Any] | None = None) -> RewardFunction:
    if name not in BUILTIN and ":" not in name and "." not in name:
        raise ConfigError(f"unknown reward function '{name}': built-ins are {', '.join(BUILTIN)}; "
                         "or give path.py:function or module:function")
    if name in NEEDS and importlib.util.find_spec(NEEDS[name][0]) is None:
        raise ConfigError(f"reward function '{name}' needs {NEEDS[name][1]}: pip install {NEEDS[name][1]}")
    fn = BUILTIN.get(name) or import_object(name)
    if not callable(fn):
        raise ConfigError(f"reward function '{name}' is not callable")
    params = inspect.signature(fn).parameters
    kwargs = dict(kwargs or {})
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            raise ConfigError(f"reward function '{name}' takes no argument(s) {unknown} given in function_kwargs; "
                              f"its parameters: {', '.join(params)}")
    return RewardFunction(name, fn, weight, verl_style="solution_str" in params, kwargs=kwargs)


def _as_score(name: str, value: Any) -> tuple[float, dict[str, float]]:
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"reward function '{name}' returned a dict without 'score': {sorted(value)}")
        extras = {f"{name}/{k}": float(v) for k, v in value.items() if k != "score" and isinstance(v, numbers.Real)}
        value = value["score"]
    if not isinstance(value, numbers.Real):  # numbers.Real: also numpy scalars and bools
        raise TypeError(f"reward function '{name}' must return a number or a dict with 'score', "
                        f"got {type(value).__name__}")
    score = float(value)
    if not math.isfinite(score):  # a NaN would poison the whole batch's advantages
        raise ValueError(f"reward function '{name}' returned {score}")
    return score, extras


async def score_trajectory(traj: Trajectory, functions: list[RewardFunction], use_tool_rewards: bool = True,
                           use_interaction_rewards: bool = True) -> None:
    """Fill `traj.reward` (the total) and `traj.reward_parts` (each named part)."""
    total = 0.0
    for rf in functions:
        try:
            score, extras = _as_score(rf.name, await rf(traj))
        except RewardError as exc:
            traj.add_error(exc.kind, f"{rf.name}: {exc}")
            traj.metrics.update({f"{rf.name}/{k}": float(v) for k, v in exc.metrics.items()})
            continue
        except Exception as exc:  # noqa: BLE001 - a reward failure masks this sample, it is not a zero
            traj.add_error("reward", f"{rf.name}: {type(exc).__name__}: {exc}")
            continue
        traj.reward_parts[rf.name] = score
        traj.metrics.update(extras)
        total += rf.weight * score
    for key, value in traj.reward_parts.items():
        if (key.startswith("tool:") and use_tool_rewards) or (key == "interaction" and use_interaction_rewards):
            total += value
    for turn in traj.turns:
        turn.reward = turn.tool_reward * use_tool_rewards + turn.user_reward * use_interaction_rewards
        total += turn.reward
    step_tool = sum(t.tool_reward for t in traj.turns)
    step_user = sum(t.user_reward for t in traj.turns)
    if step_tool:
        traj.reward_parts["step:tool"] = step_tool
    if step_user:
        traj.reward_parts["step:interaction"] = step_user
    traj.reward = total


async def score_all(trajectories: list[Trajectory], functions: list[RewardFunction], use_tool_rewards: bool = True,
                    use_interaction_rewards: bool = True) -> None:
    await asyncio.gather(*(score_trajectory(t, functions, use_tool_rewards, use_interaction_rewards)
                           for t in trajectories))
