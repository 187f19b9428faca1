"""Pipelined rollouts with a staleness bound: engines sample ahead while the trainer updates.

Versions: the trainer's policy version v is the number of updates applied; the engines hold version e (the
last one synced to them). Batch b is trained by update b, i.e. at trainer version b. A batch is started with
the engines' current version e, recorded on each of its trajectories as `policy_version`, and may start only
if b - e <= max_staleness: when it is trained, its samples are at most `max_staleness` versions old.

- max_staleness = 0 is the synchronous loop: batch b starts after update b-1 and its sync (e = b); the step
  waits for the slowest trajectory, then the engines wait for the update.
- max_staleness = k >= 1: as soon as a sync brings the engines to version e, every batch up to e + k is
  started; with k = 1, batch b+1 is sampled while update b runs, and the engines never idle during updates.
  Weights are synced right after each update, also while trajectories are in flight: they finish on the new
  weights. Each token's engine logprob is that of the weights that sampled it, so the importance weights
  (`algo.tis_cap`: truncated exp(trainer - engine logprob), per token) correct every token exactly, and a
  trajectory's `policy_version` (the oldest weights that touched it) keeps the bound conservative.

Data order does not depend on the mode: batch b always gets the b-th slice of the data.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Generic, TypeVar

T = TypeVar("T")


class Pipeline(Generic[T]):
    """Starts `launch(batch, engine_version)` coroutines as the staleness bound allows; `take` hands them out
    in order."""

    def __init__(self, launch: Callable[[int, int], Awaitable[T]], start: int, steps: int, max_staleness: int):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.launch, self.steps, self.max_staleness = launch, steps, max_staleness
        self.version = start              # the engines' weights
        self.next = start                 # the next batch to start
        self.pending: dict[int, tuple[asyncio.Task, int]] = {}

    def fill(self) -> None:
        while self.next < self.steps and self.next - self.version <= self.max_staleness:
            task = asyncio.ensure_future(self.launch(self.next, self.version))
            self.pending[self.next] = (task, self.version)
            self.next += 1

    async def take(self, batch: int) -> tuple[T, int]:
        """(the batch's result, the engine version it started with); starts what the bound allows first."""
        self.fill()
        if batch not in self.pending:
            raise AssertionError(f"batch {batch} was never started (next {self.next}, engines at v{self.version})")
        task, version = self.pending.pop(batch)
        assert batch - version <= self.max_staleness, (batch, version)
        return await task, version

    def synced(self, version: int) -> None:
        """The engines now hold `version`; later batches may start (at the next `take`)."""
        self.version = version

    @property
    def in_flight(self) -> int:
        return sum(not task.done() for task, _ in self.pending.values())

    async def close(self) -> None:
        for task, _ in self.pending.values():
            task.cancel()
        await asyncio.gather(*(task for task, _ in self.pending.values()), return_exceptions=True)
        self.pending.clear()
