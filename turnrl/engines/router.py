"""One engine in front of many replicas: load-aware, sticky per trajectory, and honest about failures.

Routing (`Router.generate`):
- A request carries its trajectory's id (`Sampling.session`, set by the agent loop). The first turn of a
  trajectory goes to the ready replica with the least work in flight: the fewest in-flight tokens (prompt +
  `max_tokens` of every request it is serving), then the fewest in-flight requests, then the lowest id. Round
  robin would send a 4k-token turn and a 40-token turn to the same place in turn; counting tokens does not.
- Every later turn of that trajectory goes to the same replica, the one whose prefix cache holds the
  conversation so far, as long as it is alive and ready (no load-based migration: a re-prefill of a long
  conversation costs more than a busy replica).
- Each served request is recorded: `assignments[session]` is the list of replica names, one per turn, which
  the trainer copies into the trajectory's metrics (`replicas`), so the ledger shows where every turn ran.

Failures:
- A replica that dies (its actor is gone) is reported to the pool, which replaces it (a new actor in the same
  bundle, brought to the current weights before it serves). The request is retried at once on another ready
  replica (the session moves there), up to `retries` times; the trajectory goes on, only its prefix cache is
  lost. Retries are counted in `stats`.
- When the retries are used up, or no replica is ready, `EngineError` is raised: the agent loop records it on
  the trajectory (an `engine` error, masked out of the loss). Nothing is dropped silently.
- An engine error inside a live replica (a bad request) is not a death: it is raised as `EngineError` as is.

The pool (`turnrl.distributed.replicas.ReplicaPool` over Ray actors, `turnrl.engines.vllm_servers.ServerPool`
over vLLM servers, or a test double) provides `replicas`, `call(replica, prompt_ids, sampling)` (raising
`ReplicaDied` when the replica is gone) and `replace(replica)`. This module is pure (no Ray), so it sits in
engines/ and both pools can use it; `turnrl.distributed.router` re-exports it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

import torch

from turnrl.engines.base import Completion, EngineBase, EngineError, Sampling


class ReplicaDied(RuntimeError):
    """The replica serving a request is gone (its actor died or was killed)."""


@dataclass(eq=False)
class ReplicaState:
    """What the router knows about one replica."""
    slot: int                      # its bundle / position; a replacement keeps it
    generation: int = 0            # how many times this slot was replaced
    ready: bool = True             # alive and holding the current weights
    in_flight: int = 0             # requests sent and not answered
    in_flight_tokens: int = 0      # their prompt + max_tokens
    served: int = 0
    handle: Any = None             # the pool's handle (a Ray actor)

    @property
    def name(self) -> str:
        return f"r{self.slot}" if self.generation == 0 else f"r{self.slot}.{self.generation}"


class Pool(Protocol):
    replicas: list[ReplicaState]

    async def call(self, replica: ReplicaState, prompt_ids: list[int], sampling: Sampling) -> Completion: ...

    def replace(self, replica: ReplicaState) -> None: ...


@dataclass
class RouterStats:
    requests: int = 0
    retries: int = 0
    deaths: int = 0
    failed: int = 0                # requests that ended in an EngineError after retries
    per_replica: Counter = field(default_factory=Counter)

    def take(self) -> dict[str, float]:
        """The counts since the last call, as metrics; starts counting afresh."""
        out = {"router/requests": float(self.requests), "router/retries": float(self.retries),
               "router/replica_deaths": float(self.deaths), "router/failed": float(self.failed)}
        if self.per_replica:
            counts = list(self.per_replica.values())
            out["router/load_imbalance"] = max(counts) / (sum(counts) / len(counts))
        self.requests = self.retries = self.deaths = self.failed = 0
        self.per_replica = Counter()
        return out


class Router(EngineBase):
    """An `Engine` over replicas: `generate` routes, `update_weights` and `close` go to the pool."""

    def __init__(self, pool: Pool, retries: int = 2):
        self.pool = pool
        self.retries = retries
        self.sticky: dict[str, ReplicaState] = {}
        self.assignments: dict[str, list[str]] = {}
        self.stats = RouterStats()

    @property
    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.pool.replicas)

    def choose(self, session: str | None) -> ReplicaState:
        ready = [r for r in self.pool.replicas if r.ready]
        if not ready:
            raise EngineError("no engine replica is ready (all died and their replacements are still starting)")
        pinned = self.sticky.get(session) if session is not None else None
        if pinned is not None and pinned.ready and pinned in ready:
            return pinned
        best = min(ready, key=lambda r: (r.in_flight_tokens, r.in_flight, r.slot))
        if session is not None:
            self.sticky[session] = best
        return best

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        self.stats.requests += 1
        cost = len(prompt_ids) + sampling.max_tokens
        for attempt in range(self.retries + 1):
            try:
                replica = self.choose(sampling.session)
            except EngineError:
                self.stats.failed += 1
                raise
            generation = replica.generation
            replica.in_flight += 1
            replica.in_flight_tokens += cost
            try:
                completion = await self.pool.call(replica, prompt_ids, sampling)
            except ReplicaDied as exc:
                # one death, however many requests saw it; a replacement already running is not dead
                if replica.ready and replica.generation == generation:
                    self.stats.deaths += 1
                    replica.ready = False
                    self.pool.replace(replica)
                if attempt == self.retries:
                    self.stats.failed += 1
                    raise EngineError(f"replica {replica.name} died and {self.retries} retries failed: {exc}") from exc
                self.stats.retries += 1
                continue
            finally:
                replica.in_flight -= 1
                replica.in_flight_tokens -= cost
            replica.served += 1
            self.stats.per_replica[replica.slot] += 1
            if sampling.session is not None:
                self.assignments.setdefault(sampling.session, []).append(replica.name)
            return completion
        raise AssertionError("unreachable")

    def pop_sessions(self, sessions: Iterable[str]) -> dict[str, list[str]]:
        """Where each of these sessions' turns ran; forgets them (their trajectories are done)."""
        out = {}
        for key in sessions:
            out[key] = self.assignments.pop(key, [])
            self.sticky.pop(key, None)
        return out

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await self.pool.update_weights(dict(named_tensors), version)

    async def close(self) -> None:
        close = getattr(self.pool, "close", None)
        if close is not None:
            await close()
