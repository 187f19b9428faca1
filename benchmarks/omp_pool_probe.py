"""What a second thread's OpenMP pool costs a CPU product: the embedded engine computes on its own thread.

    PYTHONPATH=. python benchmarks/omp_pool_probe.py [--calls 2000] [--json out.json]

One [8, 576] x [576, 1536] float32 product (a decode step's gate projection at 8 rows), `linear` and turnrl's
skinny kernel (turnrl/engines/cpu_gemm.py), us per call, median of `--repeats` rounds of `--calls` calls, on:
the main thread; a second thread while the main thread's OpenMP pool is alive (the engine's situation during a
rollout, the trainer having computed before); a second thread after the main thread released its pool
(turnrl/engines/omp_pool.py); the main thread again while the second thread's pool is alive (the update's
situation); and after the second thread released its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from turnrl.engines.cpu_gemm import load
from turnrl.engines.omp_pool import release_idle_pool


def per_call_us(fn, x, w, calls: int, repeats: int) -> float:
    for _ in range(calls // 10):
        fn(x, w)
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(x, w)
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    kernel, why = load()
    ways = {"linear": F.linear} | ({"kernel": kernel} if kernel is not None else {})
    torch.manual_seed(0)
    x, w = torch.randn(8, 576), torch.randn(1536, 576)
    report: dict = {"threads": torch.get_num_threads(), "kernel": why or "built", "us_per_call": {}}

    def measure(case: str) -> None:
        row = {name: per_call_us(fn, x, w, a.calls, a.repeats) for name, fn in ways.items()}
        report["us_per_call"][case] = row
        print(f"{case:58s} " + "  ".join(f"{k} {v:6.1f} us" for k, v in row.items()), flush=True)

    def in_thread(fn) -> None:
        t = threading.Thread(target=fn)
        t.start()
        t.join()

    measure("main thread")
    in_thread(lambda: measure("second thread, the main thread's pool alive"))
    release_idle_pool()
    in_thread(lambda: measure("second thread, the main thread's pool released"))
    done, go_on = threading.Event(), threading.Event()

    def engine_like(release: bool) -> None:
        F.linear(x, w)                 # this thread's pool now exists
        if release:
            release_idle_pool()
        done.set()
        go_on.wait()

    for release in (False, True):
        done.clear()
        go_on.clear()
        t = threading.Thread(target=engine_like, args=(release,))
        t.start()
        done.wait()
        measure("main thread, a waiting thread's pool " + ("released" if release else "alive"))
        go_on.set()
        t.join()
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
