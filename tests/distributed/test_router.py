"""The router: load-aware first turns, sticky later turns, dead replicas replaced and their requests retried."""

import asyncio

import pytest

from turnrl.distributed.router import ReplicaDied, ReplicaState, Router
from turnrl.engines.base import Completion, EngineError, Sampling


class FakePool:
    """Replicas that answer after `delay` seconds; `dead` slots raise ReplicaDied; `replace` revives them."""

    def __init__(self, n: int, delay: float = 0.0):
        self.replicas = [ReplicaState(slot=i) for i in range(n)]
        self.delay = delay
        self.dead: set[int] = set()
        self.replaced: list[int] = []
        self.calls: list[tuple[int, str | None]] = []

    async def call(self, replica, prompt_ids, sampling):
        self.calls.append((replica.slot, sampling.session))
        await asyncio.sleep(self.delay)
        if replica.slot in self.dead:
            raise ReplicaDied("killed")
        return Completion([replica.slot], [0.0], "stop")

    def replace(self, replica):
        self.replaced.append(replica.slot)
        replica.generation += 1
        self.dead.discard(replica.slot)  # ready only after the next weight sync (the pool decides)


def run(coro):
    return asyncio.run(coro)


def test_new_trajectories_go_to_the_replica_with_the_fewest_tokens_in_flight():
    pool = FakePool(2, delay=0.05)
    router = Router(pool)

    async def scenario():
        long = asyncio.create_task(router.generate(list(range(1000)), Sampling(max_tokens=500, session="a")))
        await asyncio.sleep(0)
        # three short requests arrive while the long one runs on r0: all go to r1 (round robin would alternate)
        short = [asyncio.create_task(router.generate([1, 2], Sampling(max_tokens=4, session=f"s{i}")))
                 for i in range(3)]
        return await long, await asyncio.gather(*short)
    long, short = run(scenario())
    assert long.token_ids == [0]
    assert [c.token_ids for c in short] == [[1], [1], [1]]


def test_every_turn_of_a_trajectory_stays_on_its_replica():
    pool = FakePool(3)
    router = Router(pool)

    async def conversation(session):
        for turn in range(4):
            await router.generate([1] * (10 + turn), Sampling(max_tokens=8, session=session))

    async def scenario():
        await asyncio.gather(*(conversation(f"t{i}") for i in range(9)))
    run(scenario())
    where = router.pop_sessions([f"t{i}" for i in range(9)])
    assert all(len(turns) == 4 and len(set(turns)) == 1 for turns in where.values())
    assert len({turns[0] for turns in where.values()}) == 3        # the trajectories spread over all replicas
    assert router.sticky == {}                                      # popped sessions are forgotten


def test_a_dead_replica_is_replaced_and_its_request_retried_elsewhere():
    pool = FakePool(2)
    router = Router(pool, retries=2)
    first = run(router.generate([1], Sampling(max_tokens=4, session="t")))
    home = first.token_ids[0]
    pool.dead.add(home)
    again = run(router.generate([1, 2], Sampling(max_tokens=4, session="t")))
    assert again.token_ids == [1 - home]                 # retried on the other replica
    assert pool.replaced == [home]
    assert not pool.replicas[home].ready                 # not used until it holds the current weights
    stats = router.stats.take()
    assert stats["router/replica_deaths"] == 1 and stats["router/retries"] == 1
    assert router.pop_sessions(["t"])["t"] == [f"r{home}", f"r{1 - home}"]


def test_when_every_replica_is_gone_the_request_fails_as_an_engine_error():
    pool = FakePool(2)
    router = Router(pool, retries=1)
    pool.dead.update({0, 1})
    with pytest.raises(EngineError):
        run(router.generate([1], Sampling(max_tokens=4, session="t")))
    assert router.stats.failed == 1
    with pytest.raises(EngineError, match="no engine replica is ready"):
        run(router.generate([1], Sampling(max_tokens=4, session="u")))


def test_an_engine_error_in_a_live_replica_is_not_a_death():
    pool = FakePool(1)

    async def failing(replica, prompt_ids, sampling):
        raise EngineError("bad request")
    pool.call = failing
    router = Router(pool)
    with pytest.raises(EngineError, match="bad request"):
        run(router.generate([1], Sampling(max_tokens=4)))
    assert pool.replaced == [] and pool.replicas[0].ready


def test_the_agent_loop_records_a_failed_request_on_its_trajectory(smol_template):
    """A trajectory whose replicas all died ends with an `engine` error, masked: recorded, never lost."""
    from turnrl.chat.parsers import HermesParser
    from turnrl.data.rows import Task
    from turnrl.rollout.loop import AgentLoop, Environment, Limits
    pool = FakePool(1)
    pool.dead.add(0)
    loop = AgentLoop(Router(pool, retries=0), smol_template, HermesParser(), Environment(), Limits(),
                     Sampling(max_tokens=8))
    traj = run(loop.run(Task(uid="q", messages=[{"role": "user", "content": "hi"}]), 0))
    assert traj.termination == "error" and traj.masked
    assert [e.kind for e in traj.errors] == ["engine"]
    assert pool.calls[0][1] == "0:q/0"                   # the loop names the trajectory in every request
