"""How the exact mode's Triton kernels are built: once each, on first use, and not at all where Triton is
missing (CPU builds of torch) or `TURNRL_EXACT_TRITON=0` (to measure what they save); then their callers take
the plain torch paths of `turnrl.exact.ops`. Shared by `triton_tree` (the pairwise sum trees) and `triton_ops`
(the layer's kernels)."""

from __future__ import annotations

import functools
import os
from typing import Any

MAX_WIDTH = 4096      # entries per row one program holds in registers (RMSNorm's hidden size, keys per block...)


def pow2(n: int, floor: int = 1) -> int:
    """The least power of two >= n and >= floor (block widths, tree widths)."""
    return max(floor, 1 << max(n - 1, 0).bit_length())


def kernel_builder(build: Any) -> Any:
    """A kernel builder, run once: `build(triton, triton.language)` -> the compiled kernel(s), or None where
    Triton is not there (CPU builds of torch) or TURNRL_EXACT_TRITON=0. `.cache_clear()` rebuilds (tests)."""
    @functools.lru_cache(maxsize=1)
    def built() -> Any:
        if os.environ.get("TURNRL_EXACT_TRITON", "1") == "0":
            return None
        try:
            import triton
            import triton.language as tl
        except ImportError:
            return None
        return build(triton, tl)
    return built


def usable_on(device: Any, kernels: Any) -> bool:
    """Whether `kernels()` (a cached builder of compiled Triton kernels) builds for `device`: CUDA only."""
    if device.type != "cuda":
        return False
    try:
        kernels()
    except Exception:  # noqa: BLE001 - no Triton
        return False
    return True
