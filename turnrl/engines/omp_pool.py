"""Give back an idle thread's OpenMP workers, so the thread that computes next gets OpenMP's fast wake-ups.

PyTorch's CPU ops (and MKL's, and turnrl's decode kernel) run their parallel parts on libgomp, which keeps a
pool of worker threads for each thread that has started a parallel region. Between regions the workers spin
for a while before they sleep, so back-to-back regions start at once; but once libgomp manages more threads
than the process has CPUs, it spins only ~100 times. A turnrl process on a CPU has (at least) two such
threads: the trainer's (the asyncio thread, which runs the update) and the embedded engine's worker. With
both pools alive on a 2-core machine the workers sleep after every region and each region pays a wake-up: a
[8, 576] x [576, 1536] product took 170-180 us against 80-95 us (`python benchmarks/omp_pool_probe.py`), and a
CPU decode step makes ~250 such regions.

`release_idle_pool()` frees the calling thread's pool (OpenMP 5's `omp_pause_resource_all`, which libgomp
implements by ending the caller's workers); the next region the thread starts makes a new one (~0.1 ms). The
engine's worker calls it when it runs out of requests, the trainer before it waits on a rollout. It acts only
on the libgomp already loaded in the process (PyTorch's Linux wheels ship one); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os

OMP_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    import torch  # noqa: F401  (loads the libgomp its ops use, if it has one)
    mode = getattr(os, "RTLD_NOLOAD", 0)
    if not mode:
        return None
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=mode)   # only a libgomp already in the process
    except OSError:
        return None
    return lib if hasattr(lib, "omp_pause_resource_all") else None


def release_idle_pool() -> bool:
    """End the calling thread's OpenMP workers; True if libgomp did (False: no libgomp, or called inside a
    parallel region)."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
