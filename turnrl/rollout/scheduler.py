"""Run many trajectories concurrently: `n` samples per task, bounded concurrency, live progress.

Every trajectory is its own coroutine; the engine batches whatever requests are in flight, so a trajectory
waiting on a slow tool never holds the others back (no lockstep rounds).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any, Callable

from turnrl.data.rows import Task
from turnrl.ledger import Source, Trajectory
from turnrl.rollout.loop import AgentLoop


async def run_batch(loop: AgentLoop, tasks: list[Task], n: int, concurrency: int,
                    on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
    """All `n` samples of every task; results ordered by (task, sample)."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(task: Task, k: int) -> Trajectory:
        async with semaphore:
            traj = await loop.run(task, k)
        if on_done is not None:
            on_done(traj)
        return traj

    return list(await asyncio.gather(*(one(t, k) for t in tasks for k in range(n))))


def summarize(trajectories: list[Trajectory], seconds: float) -> dict[str, Any]:
    """Batch metrics: turns, tool calls and errors, terminations, parity, tokens and throughput."""
    n = max(len(trajectories), 1)
    policy = sum(t.n_tokens(Source.POLICY) for t in trajectories)
    env = sum(t.n_tokens(Source.TOOL) + t.n_tokens(Source.USER) for t in trajectories)
    calls = sum(len(turn.tool_calls) for t in trajectories for turn in t.turns)
    errors = Counter(e.kind for t in trajectories for e in t.errors)
    out: dict[str, Any] = {
        "trajectories": len(trajectories),
        "turns_mean": sum(len(t.turns) for t in trajectories) / n,
        "tool_calls": calls,
        "tool_calls_per_traj": calls / n,
        "tool_call_rate": sum(any(turn.tool_calls for turn in t.turns) for t in trajectories) / n,
        "tool_errors": sum(v for k, v in errors.items() if k.startswith("tool")),
        "masked": sum(t.masked for t in trajectories),
        "policy_tokens": policy,
        "env_tokens": env,
        "response_tokens_mean": policy / n,
        "seconds": seconds,
        "policy_tokens_per_s": policy / seconds if seconds > 0 else 0.0,
        "reward_mean": sum(t.reward for t in trajectories) / n,
    }
    for kind, count in sorted(errors.items()):
        out[f"errors/{kind}"] = count
    for reason, count in sorted(Counter(t.termination for t in trajectories).items()):
        out[f"termination/{reason}"] = count
    for parity, count in sorted(Counter(t.parity for t in trajectories).items()):
        out[f"parity/{parity}"] = count
    return out


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start
