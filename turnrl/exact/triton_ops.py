"""`ops.tree_sum` on CUDA in one kernel: the same pairwise tree, the same bits, one launch instead of one per level.

The plain tree sum is a chain of elementwise adds, one kernel per level (plus the padding copy): an exact
decode step ran ~820 of them, tiny ones, and they were a fifth of its time. Here a Triton program loads a
block of rows zero-padded to the power of two P, and halves it LEVELS times: entry i of a level is entry i
plus entry i + P / 2**j of the level before, exactly the order of `ops.tree_levels`. Float32 adds are
correctly rounded whatever unit runs them and nothing else touches the values (no multiply to fuse into an
FMA), so the result equals the plain tree's bit for bit; tests/exact/test_ops.py checks it on the GPU. The
order depends only on P, never on how many rows share a program or a launch, so it stays batch-invariant.

Used for float32 sums over at most `MAX_WIDTH` entries on CUDA when Triton imports (it comes with CUDA builds
of torch); the vocabulary-wide sums of the head, and every CPU sum, keep the plain tree.
A fused RMSNorm (cast, squares, this tree and the scale in one kernel) was tried and left out: Triton 3.6
took over two minutes to compile it for a 1024-wide bf16 row (in LLVM lowering of the tree's reshapes).

`TURNRL_EXACT_TRITON=0` turns it off (to measure what it saves).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

MAX_WIDTH = 4096      # entries per row one program holds in registers (RMSNorm's hidden size, keys per block...)
BLOCK_ELEMENTS = 8192  # rows per program x P


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    """The compiled kernel, or None where Triton is not there (CPU builds of torch)."""
    if os.environ.get("TURNRL_EXACT_TRITON", "1") == "0":
        return None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def tree_sum_rows(x_ptr, out_ptr, rows, n, BLOCK_ROWS: tl.constexpr, P: tl.constexpr, LEVELS: tl.constexpr):
        r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        c = tl.arange(0, P)
        mask = (r[:, None] < rows) & (c[None, :] < n)
        x = tl.load(x_ptr + r[:, None].to(tl.int64) * n + c[None, :], mask=mask, other=0.0)
        for level in tl.static_range(LEVELS):
            # [.., i, 0] = x[i], [.., i, 1] = x[i + half], half = P >> (level + 1)
            pairs = tl.permute(tl.reshape(x, (BLOCK_ROWS, 2, P >> (level + 1))), (0, 2, 1))
            first, second = tl.split(pairs)
            x = first + second
        tl.store(out_ptr + r, tl.reshape(x, (BLOCK_ROWS,)), mask=r < rows)

    return tree_sum_rows


def usable(x: torch.Tensor) -> bool:
    """`tree_sum_last` takes `x`: float32 on CUDA, rows of at most MAX_WIDTH, Triton there."""
    return x.is_cuda and x.dtype == torch.float32 and 0 < x.shape[-1] <= MAX_WIDTH and _kernel() is not None


def _grid(rows: int, n: int) -> tuple[tuple[int], int, int]:
    width = 1 << max(n - 1, 0).bit_length()
    block_rows = max(1, min(128, BLOCK_ELEMENTS // width))
    return ((rows + block_rows - 1) // block_rows,), block_rows, width


def _launch(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    lead = x.shape[:-1]
    flat = x.reshape(-1, n).contiguous()
    rows = flat.shape[0]
    out = torch.empty(rows, dtype=x.dtype, device=x.device)
    if rows:
        grid, block_rows, width = _grid(rows, n)
        # enable_fp_fusion off: nothing here should become an FMA (there is no multiply, but say so)
        _kernel()[grid](flat, out, rows, n, BLOCK_ROWS=block_rows, P=width, LEVELS=width.bit_length() - 1,
                        enable_fp_fusion=False)
    return out.reshape(lead)


class _TreeSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        return _launch(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.unsqueeze(-1).expand(ctx.shape)


def tree_sum_last(x: torch.Tensor) -> torch.Tensor:
    """The tree sum over the last axis of a CUDA float32 tensor (`usable(x)`), differentiable."""
    return _TreeSum.apply(x)
