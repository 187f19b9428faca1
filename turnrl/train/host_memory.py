"""Keep freed host memory in the process, so a CPU trainer's next micro-batch does not fault it in again.

A CPU update allocates and frees gigabytes of activations each micro-batch (SmolLM2-135M in fp32 at 4,096
tokens: a peak of ~8 GB). glibc's malloc hands large blocks back to the kernel on free (memory above
M_MMAP_THRESHOLD is mmap'ed; free space at the top of the heap beyond M_TRIM_THRESHOLD is trimmed), and every
page of the next allocation is then zeroed by a page fault. Measured on the wide calculator update (2-core
EPYC, fp32): 190-280 thousand faults per update with glibc's defaults and none once the heap is kept,
~2 s of a ~25 s update. The price is that the process keeps its peak heap (up to 2 GiB of free space at
the top is kept; allocations from 1 GiB up still go to mmap and back).

`retain_freed_memory` sets the two thresholds with `mallopt`. It acts only on glibc (elsewhere it returns
False and changes nothing) and only on what this process allocates from then on.
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
KEEP_TOP_BYTES = (1 << 31) - 1   # mallopt takes an int: free space kept at the heap's top
MMAP_FROM_BYTES = 1 << 30        # single allocations this large still come from (and go back to) mmap


def retain_for_training(device_type: str, enabled: bool) -> bool:
    """What the trainers call once they know their device (`trainer.retain_host_memory`): on a CPU only, since
    a GPU trainer's activations are not in host memory."""
    return enabled and device_type == "cpu" and retain_freed_memory()


def retain_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse; True when it took both settings."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):   # glibc only: musl and others have no such symbol
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_FROM_BYTES)) and bool(libc.mallopt(_M_TRIM_THRESHOLD,
                                                                                     KEEP_TOP_BYTES))
