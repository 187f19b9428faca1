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
import time
from dataclasses import dataclass
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


@dataclass
class Group(Generic[T]):
    """One prompt's samples, launched for `batch` on engine weights `version` at `started_at`; `finished_at`
    once done (both perf_counter seconds)."""
    batch: int
    version: int
    task: asyncio.Task
    started_at: float
    finished_at: float | None = None


class CarryPool(Generic[T]):
    """Batches that close before their slowest groups finish (`trainer.carry_over`).

    Every batch launches its `want` groups (with the staleness bound, batches up to max_staleness ahead are
    running). Batch b takes the first `want` groups to finish among all launched and not yet taken, its own, an
    earlier batch's or a later one's, but every group launched for batch b - carry or earlier first: a group is
    carried into at most `carry` later batches, and the last of them waits for it. So a batch no longer waits
    for its slowest trajectories unless they are `carry` batches old; with partial rollouts they go on with the
    newest weights meanwhile. A group launched on weights v for batch j trains at step <= j + carry, so at most
    max_staleness + carry versions late. A batch is taken only after the one before it: no group is taken twice.
    """

    def __init__(self, want: int, carry: int, start: int = 0):
        if want < 1 or carry < 0:
            raise ValueError(f"a carry pool needs want >= 1 and carry >= 0, got {want} and {carry}")
        self.want, self.carry = want, carry
        self.groups: list[Group[T]] = []
        self.taken = start - 1           # the last batch taken
        self.changed = asyncio.Event()

    def add(self, batch: int, version: int, coroutine: Awaitable[T]) -> Group[T]:
        group: Group[T] = Group(batch, version, asyncio.ensure_future(coroutine), time.perf_counter())
        group.task.add_done_callback(lambda _: self._finished(group))
        self.groups.append(group)
        return group

    def _finished(self, group: Group[T]) -> None:
        group.finished_at = time.perf_counter()
        self.changed.set()

    def _ready(self, batch: int) -> list[Group[T]] | None:
        forced = [g for g in self.groups if g.batch <= batch - self.carry]
        # groups are kept in launch order and the sort is stable: ties go to the earlier launch
        finished = sorted((g for g in self.groups if g.finished_at is not None), key=lambda g: g.finished_at)
        if any(g.finished_at is None for g in forced) or len(finished) < min(self.want, len(self.groups)):
            return None
        rest = [g for g in finished if g.batch > batch - self.carry]
        return forced + rest[:max(0, self.want - len(forced))]

    async def take(self, batch: int) -> list[Group[T]]:
        """The groups batch `batch` trains on (results via `group.task.result()`), once it may close."""
        while self.taken < batch - 1 or (picked := self._ready(batch)) is None:
            self.changed.clear()
            await self.changed.wait()
        chosen = {id(g) for g in picked}
        self.groups = [g for g in self.groups if id(g) not in chosen]
        self.taken = batch
        self.changed.set()
        return picked

    def carried(self, batch: int) -> int:
        """Groups launched for `batch` or earlier and not yet taken."""
        return sum(g.batch <= batch for g in self.groups)

    async def close(self) -> None:
        for g in self.groups:
            g.task.cancel()
        await asyncio.gather(*(g.task for g in self.groups), return_exceptions=True)
        self.groups.clear()
