"""run_batch: n samples per task, bounded concurrency, results in (task, sample) order; summarize's metrics."""

import asyncio
import random

import pytest

from turnrl.data import Task
from turnrl.ledger import ErrorRecord, Segment, Source, ToolCall, Trajectory, Turn
from turnrl.rollout.scheduler import Timer, run_batch, summarize


class SlowLoop:
    """Stands in for AgentLoop: finishes trajectories in a random order and tracks how many run at once."""

    def __init__(self):
        self.active = self.peak = 0
        self.rng = random.Random(0)

    async def run(self, task, sample_index):
        self.active += 1
        self.peak = max(self.peak, self.active)
        await asyncio.sleep(self.rng.random() * 0.02)
        self.active -= 1
        return Trajectory(group_id=task.uid, sample_index=sample_index, messages=[], termination="eos")


def tasks(k):
    return [Task(uid=f"t{i}", messages=[{"role": "user", "content": str(i)}]) for i in range(k)]


def test_all_samples_in_task_sample_order_with_bounded_concurrency():
    loop, done = SlowLoop(), []
    trajs = asyncio.run(run_batch(loop, tasks(5), n=3, concurrency=4, on_done=lambda t: done.append(t)))
    assert [(t.group_id, t.sample_index) for t in trajs] == [(f"t{i}", k) for i in range(5) for k in range(3)]
    assert loop.peak == 4
    assert sorted(id(t) for t in done) == sorted(id(t) for t in trajs)
    assert [(t.group_id, t.sample_index) for t in done] != [(t.group_id, t.sample_index) for t in trajs]


def trajectory(termination, policy, tool=0, user=0, calls=0, reward=0.0, errors=(), parity="exact", masked=False):
    seg = Segment()
    seg.append([1] * 3, Source.PROMPT, 0)
    seg.append([5] * policy, Source.POLICY, 0, [-0.1] * policy)
    seg.append([6] * tool, Source.TOOL, 0)
    seg.append([7] * user, Source.USER, 0)
    turn = Turn(0, 0, 3, 3 + policy, "stop", "", tool_calls=[ToolCall("calc", {}, "") for _ in range(calls)])
    return Trajectory(group_id="g", sample_index=0, messages=[], segments=[seg], turns=[turn, Turn(1, 0, 0, 0, "stop", "")],
                      termination=termination, reward=reward, parity=parity, masked=masked,
                      errors=[ErrorRecord(kind, "m") for kind in errors])


def test_summarize_counts():
    trajs = [trajectory("eos", 10, tool=4, calls=2, reward=1.0, errors=["tool_parse"]),
             trajectory("token_budget", 20, user=6, reward=0.5, errors=["tool_error", "interaction"], masked=True),
             trajectory("eos", 30, parity="token_drift")]
    summary = summarize(trajs, seconds=2.0)
    assert summary["trajectories"] == 3 and summary["turns_mean"] == 2
    assert summary["tool_calls"] == 2 and summary["tool_calls_per_traj"] == pytest.approx(2 / 3)
    assert summary["tool_errors"] == 2 and summary["masked"] == 1
    assert summary["policy_tokens"] == 60 and summary["env_tokens"] == 10
    assert summary["response_tokens_mean"] == 20 and summary["policy_tokens_per_s"] == 30
    assert summary["reward_mean"] == pytest.approx(0.5)
    assert summary["errors/tool_parse"] == 1 and summary["errors/interaction"] == 1
    assert summary["termination/eos"] == 2 and summary["termination/token_budget"] == 1
    assert summary["parity/exact"] == 2 and summary["parity/token_drift"] == 1


def test_summarize_empty_and_timer():
    summary = summarize([], seconds=0.0)
    assert summary["trajectories"] == 0 and summary["reward_mean"] == 0 and summary["policy_tokens_per_s"] == 0
    timer = Timer()
    asyncio.run(asyncio.sleep(0.02))
    assert 0.02 <= timer.seconds < 5
