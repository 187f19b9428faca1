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
    n, roll, upd = 5, 0.03, 0.03
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
