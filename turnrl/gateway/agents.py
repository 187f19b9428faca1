"""Your own agent as the rollout: `agent: {entrypoint: "pkg.module:run"}` or `agent: {command: [...]}`.

For each task, `rollout.n` sessions run concurrently (at most `rollout.concurrency` in all), each with its own
gateway session on the trainer's engine:
- entrypoint: `run(row, client)` is called with the task as a plain dict (`row`: uid, index, sample, messages,
  ground_truth, data_source, extra, model) and an `openai.AsyncOpenAI` client whose base URL is the session's
  (a plain `def run` runs in a thread and gets an `openai.OpenAI`). It may return the reward (a number), or
  None when `agent.returns_reward` is false and `reward.functions` score the recorded conversation.
- command: one process per session, with `OPENAI_BASE_URL`, `OPENAI_API_KEY`, `TURNRL_MODEL`, `TURNRL_TASK`
  (the row as JSON) in its environment; its reward is the last line of its stdout (a number, or JSON with
  "reward").
When the agent returns, its session is closed into one `Trajectory` (turnrl/gateway/capture.py). An agent
that raises, exits non-zero or runs past `agent.timeout_s` is an environment failure on its trajectory
(recorded, masked out of the loss, counted); the rest of the batch goes on. Sampling is pinned to the
config's (the gateway's `pin_sampling`), so the trainer recomputes logprobs at the temperature they were
sampled with.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
import numbers
import os
import time
from typing import Any, Callable

from turnrl.data.rows import Task
from turnrl.engines.base import Sampling
from turnrl.gateway.app import build_app
from turnrl.gateway.server import async_client, running, sync_client
from turnrl.gateway.service import Defaults, Gateway
from turnrl.ledger import Trajectory
from turnrl.rewards.functions import RewardFunction

API_KEY = "turnrl-session"   # the session id in the URL is the credential; clients insist on some key
MODEL = "policy"


def agent_reward(weight: float) -> RewardFunction:
    """The reward the agent returned, as the part 'agent' (an error when it returned none)."""
    def returned(traj: Trajectory) -> float:
        value = traj.info.get("agent_reward")
        if value is None:
            raise ValueError("the agent returned no reward; return a number from run(), print it as the last "
                             "line (command), or set agent.returns_reward=false and configure reward.functions")
        return value
    return RewardFunction("agent", returned, weight)


def task_row(task: Task, sample: int) -> dict[str, Any]:
    return {"uid": task.uid, "index": task.index, "sample": sample, "messages": [dict(m) for m in task.messages],
            "ground_truth": task.ground_truth, "data_source": task.data_source, "extra": task.extra, "model": MODEL}


def parse_reward(stdout: str) -> float | None:
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    last = lines[-1]
    try:
        value = json.loads(last)
    except ValueError:
        return None
    if isinstance(value, dict):
        value = value.get("reward")
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None


class AgentRollout:
    """Runs agents against a gateway on `engine`; the HTTP server starts on first use and stops in `close`."""

    def __init__(self, gateway: Gateway, entrypoint: str | None = None, command: list[str] | None = None,
                 timeout_s: float = 300.0, env: dict[str, str] | None = None):
        from turnrl.env.loading import import_object
        self.gateway = gateway
        self.run_fn: Callable[..., Any] | None = import_object(entrypoint) if entrypoint else None
        if self.run_fn is not None and not callable(self.run_fn):
            raise ValueError(f"agent.entrypoint '{entrypoint}' is not callable")
        self.command = list(command) if command else None
        self.timeout_s = timeout_s
        self.env = dict(env or {})
        self._stack: contextlib.AsyncExitStack | None = None
        self.url = ""

    async def start(self) -> str:
        if self._stack is None:
            self._stack = contextlib.AsyncExitStack()
            self.url = await self._stack.enter_async_context(running(build_app(self.gateway)))
        return self.url

    async def close(self) -> None:
        if self._stack is not None:
            await self._stack.aclose()
            self._stack = None

    def set_sampling(self, sampling: Sampling) -> None:
        """The step's sampling (e.g. greedy for evaluation); `max_tokens` also caps what an agent asks for."""
        d = self.gateway.defaults
        self.gateway.defaults = Defaults(sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens,
                                         sampling.max_tokens, d.max_context, d.seed)

    async def run_batch(self, tasks: list[Task], n: int, concurrency: int, policy_version: int = 0,
                        on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        await self.start()
        semaphore = asyncio.Semaphore(concurrency)

        async def one(task: Task, k: int) -> Trajectory:
            async with semaphore:
                traj = await self.run_one(task, k)
            traj.policy_version = policy_version
            if on_done is not None:
                on_done(traj)
            return traj

        return list(await asyncio.gather(*(one(t, k) for t in tasks for k in range(n))))

    async def run_one(self, task: Task, sample: int) -> Trajectory:
        session = self.gateway.open_session(task.uid, sample, task.info)
        base_url = f"{self.url}/sessions/{session.id}/v1"
        row = task_row(task, sample)
        start = time.perf_counter()
        reward, error = None, None
        try:
            runner = self._call_entrypoint(row, base_url) if self.run_fn else self._call_command(row, base_url)
            reward = await asyncio.wait_for(runner, self.timeout_s)
        except asyncio.TimeoutError:
            error = f"timed out after {self.timeout_s:g}s (agent.timeout_s)"
        except Exception as exc:  # noqa: BLE001 - one broken agent run never stops the batch
            error = f"{type(exc).__name__}: {exc}"
        traj = self.gateway.close_session(session.id)
        traj.timings["total_s"] = time.perf_counter() - start
        if error is not None:
            traj.termination = "error"
            traj.add_error("agent", error)
        elif reward is not None:
            if not isinstance(reward, numbers.Real) or isinstance(reward, bool) or not math.isfinite(float(reward)):
                traj.add_error("agent", f"the agent returned {reward!r}; return a finite number or None")
            else:
                traj.info["agent_reward"] = float(reward)
        return traj

    async def _call_entrypoint(self, row: dict[str, Any], base_url: str) -> Any:
        import openai
        assert self.run_fn is not None
        if inspect.iscoroutinefunction(self.run_fn):
            http = async_client(self.timeout_s)
            client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, http_client=http)
            try:
                return await self.run_fn(row, client)
            finally:
                await client.close()
        sync_http = sync_client(self.timeout_s)
        client = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, http_client=sync_http)
        try:
            return await asyncio.to_thread(self.run_fn, row, client)
        finally:
            client.close()

    async def _call_command(self, row: dict[str, Any], base_url: str) -> float | None:
        assert self.command is not None
        env = {**os.environ, **self.env, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": API_KEY,
               "TURNRL_MODEL": MODEL, "TURNRL_TASK": json.dumps(row, default=str)}
        proc = await asyncio.create_subprocess_exec(*self.command, env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)
        try:
            out, err = await proc.communicate()
        except asyncio.CancelledError:   # timed out: the process goes with the session
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"agent command exited with {proc.returncode}: {' | '.join(tail)}")
        return parse_reward(out.decode(errors="replace"))


def build_agent_rollout(cfg: Any, engine: Any, template: Any) -> AgentRollout:
    """The agent rollout a config asks for (`cfg.agent`), on the trainer's engine, sampling pinned."""
    from turnrl.chat.parsers import get_parser
    from turnrl.gateway.serve import defaults_from
    a = cfg.agent
    if not a.returns_reward and not cfg.reward.functions and cfg.reward.judge is None:
        raise ValueError("agent.returns_reward is false and no reward.functions or reward.judge are configured: "
                         "nothing would score the agent's runs.")
    gateway = Gateway(engine, template, get_parser(cfg.rollout.tool_parser), [MODEL], defaults_from(cfg),
                      cfg.rollout.on_mismatch, pin_sampling=True)
    return AgentRollout(gateway, a.entrypoint, a.command, a.timeout_s, a.env)
