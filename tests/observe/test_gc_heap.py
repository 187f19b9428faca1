"""The garbage collector's pause counter and the heap freeze (turnrl/observe/gc_heap.py)."""

import asyncio
import gc
import weakref

import pytest

from turnrl.config.schema import EngineConfig
from turnrl.engines.factory import build_engine
from turnrl.models import prepare
from turnrl.observe.gc_heap import GcCounts, freeze_heap, gc_pauses


class Node:
    def __init__(self) -> None:
        self.me = self   # a reference cycle: only the cyclic collector frees it


def _tracked(obj: object) -> bool:
    """Whether the collector's generations hold `obj` (frozen objects are in none of them)."""
    return any(o is obj for o in gc.get_objects())


def test_pauses_count_each_generation_and_their_time():
    pauses = gc_pauses()
    assert gc_pauses() is pauses   # one counter for the process
    before = pauses.snapshot()
    gc.collect(0)
    gc.collect()
    gc.collect()
    got = pauses.since(before)
    assert got["gc/collections"] >= 3 and got["gc/full_collections"] >= 2
    assert got["time/gc_pause_s"] >= got["gc/full_pause_s"] > 0
    assert pauses.snapshot().max_pause_s > 0


def test_counts_subtract_by_generation():
    earlier = GcCounts([5, 1, 0], [0.01, 0.002, 0.0], 0.01)
    later = GcCounts([9, 2, 3], [0.02, 0.004, 0.3], 0.2)
    got = later.minus(earlier)
    assert got["gc/collections"] == 8 and got["gc/full_collections"] == 3
    assert got["gc/full_pause_s"] == pytest.approx(0.3) and got["time/gc_pause_s"] == pytest.approx(0.312)


def test_freeze_moves_live_objects_out_and_later_garbage_is_still_collected():
    try:
        kept = [[i] for i in range(1000)]
        garbage_before = weakref.ref(Node())   # unreachable already: the freeze's collection frees it
        frozen = freeze_heap()
        assert garbage_before() is None
        assert frozen.objects >= len(kept) and frozen.seconds > 0
        assert not _tracked(kept) and not any(_tracked(x) for x in kept[:10])
        made_after = [0]
        assert _tracked(made_after)
        garbage_after = weakref.ref(Node())
        gc.collect()
        assert garbage_after() is None   # objects made after a freeze are collected as before
        again = freeze_heap()            # a second freeze adds what was made since
        assert again.objects > frozen.objects and not _tracked(made_after)
    finally:
        gc.unfreeze()
    assert _tracked(kept)


@pytest.mark.parametrize("freeze", [True, False])
def test_engine_factory_freezes_the_heap_when_asked(freeze):
    gc.unfreeze()
    engine = build_engine(EngineConfig(device="cpu", dtype="float32", fast="off", gc_freeze=freeze),
                          prepare("tiny-random"))
    try:
        assert (gc.get_freeze_count() > 0) == freeze
    finally:
        gc.unfreeze()
        asyncio.run(engine.close())
