"""Python's cyclic garbage collector: its pauses, counted, and the startup heap kept out of its full collections.

A process that holds torch, transformers, a model and compiled kernels tracks hundreds of thousands of Python
objects (433k in the CPU race's training process, `benchmarks/trl_race`). CPython's full (generation 2)
collection walks all of them while holding the GIL, so every thread stops: 0.14-0.15 s a collection on the
project's 2-core CPU, 0.27-0.31 s in the GPU rollout bench's process on an H100 machine. The agent loop allocates
many short-lived objects (token lists, messages, ledger entries) and sets such collections off every few
seconds. On a GPU engine whose decode step takes 2-3 ms, one pause is a hundred lost steps, and it was most of
the spread of the multi-turn bench (README "The spread was the garbage collector").

`freeze_heap()` runs a full collection and then `gc.freeze()`: every object alive at that moment (modules,
weights' Python wrappers, compiled graphs, caches) moves to a permanent generation that later collections do
not scan. Objects made afterwards are collected as usual. vLLM does the same after its engine starts
(`vllm.utils.gc_utils.freeze_gc_heap`); turnrl does it once the engine is built (`engine.gc_freeze`, on by
default) and again after the first step or warm-up, when compilation has made its long-lived objects. The cost:
an object alive at a freeze that later dies inside a reference cycle is never freed (reference counting still
frees the rest, and the collection just before a freeze clears what is already garbage), so it is done twice,
at points where little but long-lived state is alive, not every step.

`GcPauses` counts collections and their pause time by generation through `gc.callbacks`; trainers and
benchmarks read it around a phase (`since(snapshot)`), so pauses show in the metrics (`time/gc_pause_s`).
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass, field


@dataclass
class GcCounts:
    collections: list[int] = field(default_factory=lambda: [0, 0, 0])   # by generation
    pause_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    max_pause_s: float = 0.0   # the longest single pause since the counter was installed

    def minus(self, earlier: "GcCounts") -> dict[str, float]:
        """What happened between `earlier` and this snapshot, as metrics (the max is the process's so far)."""
        return {"time/gc_pause_s": sum(self.pause_s) - sum(earlier.pause_s),
                "gc/full_collections": self.collections[2] - earlier.collections[2],
                "gc/full_pause_s": self.pause_s[2] - earlier.pause_s[2],
                "gc/collections": sum(self.collections) - sum(earlier.collections)}


class GcPauses:
    """Collections and pause seconds by generation, for the whole process (one instance: `gc_pauses()`)."""

    def __init__(self) -> None:
        self._counts = GcCounts()
        self._started: dict[int, float] = {}   # thread id -> start of the collection it runs
        self._lock = threading.Lock()
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        now, thread = time.perf_counter(), threading.get_ident()
        if phase == "start":
            self._started[thread] = now
            return
        start = self._started.pop(thread, None)
        if start is None:
            return
        pause, generation = now - start, min(int(info.get("generation", 2)), 2)
        with self._lock:
            self._counts.collections[generation] += 1
            self._counts.pause_s[generation] += pause
            self._counts.max_pause_s = max(self._counts.max_pause_s, pause)

    def snapshot(self) -> GcCounts:
        with self._lock:
            c = self._counts
            return GcCounts(list(c.collections), list(c.pause_s), c.max_pause_s)

    def since(self, earlier: GcCounts) -> dict[str, float]:
        return self.snapshot().minus(earlier)


_pauses: GcPauses | None = None
_install_lock = threading.Lock()


def gc_pauses() -> GcPauses:
    """The process's pause counter, installed on first use."""
    global _pauses
    with _install_lock:
        if _pauses is None:
            _pauses = GcPauses()
        return _pauses


@dataclass
class Frozen:
    objects: int      # in the permanent generation after this freeze (all freezes so far)
    seconds: float    # the full collection and the freeze


def freeze_heap() -> Frozen:
    """Collect everything collectable, then move every surviving tracked object out of later collections'
    reach. Safe to call again: the objects made since then join the frozen ones."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    return Frozen(gc.get_freeze_count(), time.perf_counter() - start)
