"""The pipelined driver: batches start as soon as the staleness bound allows, never later, never staler."""

import asyncio
import random

import pytest

from turnrl.distributed.async_rollout import Pipeline


def simulate(steps: int, staleness: int, rollout_s: list[float], update_s: float):
    """A fake trainer loop over the pipeline; returns (per batch: start version, trained at), events."""
    events = []
    started = {}

    async def launch(batch, version):
        started[batch] = version
        events.append(("start", batch, version))
        await asyncio.sleep(rollout_s[batch])
        events.append(("done", batch))
        return f"batch{batch}"

    async def main():
        pipe = Pipeline(launch, 0, steps, staleness)
        out = []
        for step in range(steps):
            result, version = await pipe.take(step)
            assert result == f"batch{step}"
            out.append((version, step))
            events.append(("update", step))
            await asyncio.sleep(update_s)
            events.append(("updated", step))
            pipe.synced(step + 1)
        await pipe.close()
        return out
    return asyncio.run(main()), events, started


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_no_batch_trains_more_than_max_staleness_versions_after_it_was_sampled(staleness):
    rng = random.Random(staleness)
    trained, _, started = simulate(6, staleness, [rng.uniform(0.001, 0.02) for _ in range(6)], 0.01)
    assert all(0 <= step - version <= staleness for version, step in trained)
    assert [v for v, _ in trained] == [started[b] for b in range(6)]   # the version a batch recorded is its start


def test_synchronous_mode_starts_each_batch_after_the_previous_update():
    trained, events, _ = simulate(4, 0, [0.005] * 4, 0.005)
    assert [v for v, _ in trained] == [0, 1, 2, 3]
    for b in range(1, 4):
        assert events.index(("update", b - 1)) < events.index(("start", b, b))


def test_with_staleness_one_the_next_batch_samples_during_the_update():
    trained, events, _ = simulate(4, 1, [0.01] * 4, 0.02)
    assert [v for v, _ in trained] == [0, 0, 1, 2]
    for b in range(3):  # batch b+1 is sampling while update b runs
        start = next(i for i, e in enumerate(events) if e[:2] == ("start", b + 1))
        assert start < events.index(("updated", b))


def test_pipelining_hides_the_update_time():
    n, roll, upd = 5, 0.1, 0.1      # ~1.0 s against ~0.6 s: a 200 ms stall does not reach the 0.8 bound
    loop = asyncio.new_event_loop()
    try:
        t0 = loop.time()
        simulate(n, 0, [roll] * n, upd)
        sync = loop.time() - t0
        t0 = loop.time()
        simulate(n, 1, [roll] * n, upd)
        pipelined = loop.time() - t0
    finally:
        loop.close()
    assert pipelined < sync * 0.8


# -- carry-over: batches close at `want` finished groups; the rest run on into later batches ---------------------
def simulate_carry(steps: int, want: int, staleness: int, carry: int, duration, update_s: float = 0.02):
    """The trainer's use of CarryPool under the Pipeline; per step, the (batch, index, version) of its groups."""
    from turnrl.distributed.async_rollout import CarryPool

    async def main():
        pool = CarryPool(want, carry)

        async def group(batch, i):
            await asyncio.sleep(duration(batch, i))
            return batch, i

        async def launch(batch, version):
            for i in range(want):
                pool.add(batch, version, group(batch, i))
            return await pool.take(batch)

        pipe = Pipeline(launch, 0, steps, staleness)
        trained = []
        for step in range(steps):
            groups, _ = await pipe.take(step)
            trained.append([(*g.task.result(), g.version) for g in groups])
            await asyncio.sleep(update_s)
            pipe.synced(step + 1)
        await pipe.close()
        await pool.close()
        return trained
    return asyncio.run(main())


def straggler(batch, i):
    return 0.4 if i == 0 else 0.01 * (i + 1)       # group 0 of every batch is slow


@pytest.mark.parametrize("carry", [1, 2])
def test_every_group_trains_once_within_carry_batches_and_the_staleness_bound(carry):
    steps, want = 5, 4
    trained = simulate_carry(steps, want, 1, carry, straggler)
    assert [len(groups) for groups in trained] == [want] * steps
    every = [(b, i) for groups in trained for b, i, _ in groups]
    assert sorted(every) == [(b, i) for b in range(steps) for i in range(want)]      # each exactly once
    for step, groups in enumerate(trained):
        for batch, _, version in groups:
            assert step - batch <= carry and 0 <= step - version <= 1 + carry


def later_stragglers(batch, i):
    """Group 0 of batch b takes 0.4 + 0.15 b s: with equal stragglers batch b's would finish only ~20 ms after
    the quick groups of batch b + 1 (launched when step b - 1 closes on batch b - 1's straggler), a margin that a
    loaded machine's scheduling delays can close."""
    return 0.4 + 0.15 * batch if i == 0 else 0.01 * (i + 1)


def test_a_batch_closes_without_its_straggler_which_the_batch_after_must_take():
    trained = simulate_carry(4, 4, 1, 1, later_stragglers)
    for step, groups in enumerate(trained[:-1]):
        mine = [(b, i) for b, i, _ in groups]
        assert (step, 0) not in mine                                  # not waited for
        assert step == 0 or (step - 1, 0) in mine                     # carried once, then forced
        assert any(b == step + 1 for b, _ in mine)                    # quick groups launched ahead fill the batch


def test_without_carry_over_a_batch_waits_for_all_its_groups():
    trained = simulate_carry(3, 4, 1, 0, straggler)
    assert [sorted((b, i) for b, i, _ in groups) for groups in trained] == \
        [[(s, i) for i in range(4)] for s in range(3)]


def test_a_carry_pool_needs_a_positive_batch():
    from turnrl.distributed.async_rollout import CarryPool
    with pytest.raises(ValueError, match="want >= 1"):
        CarryPool(0, 1)
