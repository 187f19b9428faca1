"""The exact mode's pairwise sum trees on CUDA, each in one Triton launch with the same adds in the same order
as `ops.tree_levels`, so the same bits.

`tree_sum_last`: the plain tree sum is a chain of elementwise adds, one kernel per level (plus the padding
copy): an exact decode step ran ~820 of them, tiny ones, and they were a fifth of its time. Here a Triton
program loads a block of rows zero-padded to the power of two P, and halves it LEVELS times: entry i of a level
is entry i plus entry i + P / 2**j of the level before, exactly the order of `ops.tree_levels`. Float32 adds
are correctly rounded whatever unit runs them and nothing else touches the values (no multiply to fuse into
an FMA), so the result equals the plain tree's bit for bit; tests/exact/test_ops.py checks it on the GPU. The
order depends only on P, never on how many rows share a program or a launch, so it stays batch-invariant.
Used for float32 sums over at most `MAX_WIDTH` entries on CUDA when Triton imports; every CPU sum keeps the
plain tree.

`vocab_tree`: the head's softmax tree over a vocabulary-wide row, its bottom levels in registers (below).
"""

from __future__ import annotations

from typing import Any

import torch

from turnrl.exact.triton_build import MAX_WIDTH, kernel_builder, pow2

BLOCK_ELEMENTS = 8192  # rows per program x P


@kernel_builder
def _kernel(triton: Any, tl: Any) -> Any:

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
    width = pow2(n)
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


# -- the head's softmax tree over the vocabulary -----------------------------------------------------------
# `ops.tree_levels` over a row of V logits pads it to P = 2**k and halves it k times; level b's entry i is the
# tree over the strided group i, i + W, i + 2W, ... (W = P / 2**b, S = 2**b members), member m paired with
# m + S / 2 first. This kernel computes the leaves exp(logits / t - max) once (stored: the sampler reads the
# chosen group's leaves back) and the bottom b levels in registers, group by group, and writes level b only
# ([rows, W]): the upper levels are then a small plain tree, and the same adds in the same order give the
# same bits as the full tree would. With V = 151936 that is 4 MB at batch 256 instead of ~2 GB of levels.
VOCAB_TOP_WIDTH = 4096   # W: width of the first level the kernel writes
VOCAB_BLOCK = 64         # columns of level b per program


@kernel_builder
def _vocab_kernel(triton: Any, tl: Any) -> Any:

    @triton.jit
    def exact_vocab_tree(logits_ptr, temp_ptr, top_ptr, leaves_ptr, level_ptr, V, W, s_l,
                         S: tl.constexpr, LEVELS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = tl.arange(0, S)
        idx = m[:, None] * W + c[None, :]
        live = idx < V
        t = tl.load(temp_ptr + row)
        top = tl.load(top_ptr + row)
        x = tl.load(logits_ptr + row * s_l + idx, mask=live, other=0.0).to(tl.float32)
        e = tl.where(live, tl.exp(tl.div_rn(x, t) - top), 0.0)
        tl.store(leaves_ptr + row * V + idx, e, mask=live)
        for level in tl.static_range(LEVELS):
            # [i, j, 0] = e[i], [i, j, 1] = e[i + half] along the member axis (half = S >> (level + 1))
            pairs = tl.permute(tl.reshape(e, (2, S >> (level + 1), BLOCK)), (1, 2, 0))
            first, second = tl.split(pairs)
            e = first + second
        tl.store(level_ptr + row * W + c, tl.reshape(e, (BLOCK,)))

    return exact_vocab_tree


def vocab_split(vocab: int) -> tuple[int, int]:
    """(W, b): the width of the level the kernel writes and how many levels lie below it."""
    width = pow2(vocab)
    top = min(width, VOCAB_TOP_WIDTH)
    return top, (width // top).bit_length() - 1


def vocab_usable(logits: torch.Tensor) -> bool:
    return (logits.is_cuda and logits.dtype == torch.float32 and vocab_split(logits.shape[-1])[1] > 0
            and _vocab_kernel() is not None)


def vocab_tree(logits: torch.Tensor, temperature: torch.Tensor, top: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] float32 (unit last stride), temperature [N] and top [N] (the row max of logits / t)
    -> (leaves exp(logits / t - top) [N, V], level b of their tree [N, W])."""
    n, vocab = logits.shape
    width, below = vocab_split(vocab)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    leaves = torch.empty((n, vocab), dtype=torch.float32, device=logits.device)
    level = torch.empty((n, width), dtype=torch.float32, device=logits.device)
    if n:
        _vocab_kernel()[(n, width // VOCAB_BLOCK)](
            logits, temperature.float().contiguous(), top.float().contiguous(), leaves, level, vocab, width,
            logits.stride(0), S=1 << below, LEVELS=below, BLOCK=VOCAB_BLOCK, num_warps=4, enable_fp_fusion=False)
    return leaves, level
