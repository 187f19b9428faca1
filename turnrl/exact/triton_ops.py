"""The exact mode's CUDA kernels: `ops.tree_sum` in one launch, RMSNorm, attention.

`tree_sum_last`: the same pairwise tree, the same bits, one launch instead of one per level.

The plain tree sum is a chain of elementwise adds, one kernel per level (plus the padding copy): an exact
decode step ran ~820 of them, tiny ones, and they were a fifth of its time. Here a Triton program loads a
block of rows zero-padded to the power of two P, and halves it LEVELS times: entry i of a level is entry i
plus entry i + P / 2**j of the level before, exactly the order of `ops.tree_levels`. Float32 adds are
correctly rounded whatever unit runs them and nothing else touches the values (no multiply to fuse into an
FMA), so the result equals the plain tree's bit for bit; tests/exact/test_ops.py checks it on the GPU. The
order depends only on P, never on how many rows share a program or a launch, so it stays batch-invariant.

Used for float32 sums over at most `MAX_WIDTH` entries on CUDA when Triton imports (it comes with CUDA builds
of torch); the vocabulary-wide sums of the head, and every CPU sum, keep the plain tree.
A fused RMSNorm built on this tree was tried and left out: Triton 3.6 took over two minutes to compile it
for a 1024-wide bf16 row (in LLVM lowering of the tree's reshapes). The RMSNorm here (`rms_norm`) is one
program per row with `tl.sum`, whose order is fixed by the row width and the launch constants alone, so it is
batch-invariant too; the trainer calls the same kernel, so the two sides agree without it matching the tree.

`attention` is the exact attention on CUDA: one program per (row, key/value head, tile of 16 queries) reads
keys in blocks of `KEY_BLOCK` at absolute positions 0, 64, ... in order with an online softmax; a block the
tile cannot see is skipped, which is an exact no-op, so a query's result is the same in prefill, in a
one-token decode step over any cache length, and in the trainer's pass.

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


# -- attention ----------------------------------------------------------------------------------------------
# One program per (row, key/value head, tile of QUERY_TILE queries); keys in blocks of KEY_BLOCK at absolute
# positions, in order 0, 1, ...: an online softmax whose running max, sum and output a query updates block by
# block. A block a query cannot see changes nothing exactly (max unchanged, scale exp(0) = 1, weights 0), so a
# query's bits depend on its own position, queries and keys only: not on which other queries share its tile
# (tensor-core rows are independent), how many blocks the tile visits, or the cache length. Every call uses
# the same compiled kernel (the same tile shapes and warps), so prefill, decode and the trainer's pass agree.
ATTN_WARPS = 4


@functools.lru_cache(maxsize=1)
def _attention_kernel() -> Any:
    if os.environ.get("TURNRL_EXACT_TRITON", "1") == "0":
        return None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def exact_attention(q_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, M, L, KV, scale,
                        sq_r, sq_h, sq_m, sk_r, sk_h, sk_l, sv_r, sv_h, sv_l, sp_r, so_r, so_h, so_m,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        WIDEN: tl.constexpr):
        rh = tl.program_id(0)
        r, h = rh // KV, rh % KV
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        live = rows < M
        q = tl.load(q_ptr + r.to(tl.int64) * sq_r + h * sq_h + rows[:, None] * sq_m + d[None, :],
                    mask=live[:, None] & (d[None, :] < D), other=0.0)
        if WIDEN:   # Triton's CPU interpreter (tests) computes bf16 dots wrongly: widen there
            q = q.to(tl.float32)
        qpos = tl.load(pos_ptr + r.to(tl.int64) * sp_r + rows, mask=live, other=0)
        last = tl.minimum(tl.max(qpos, axis=0) // BLOCK_N + 1, L // BLOCK_N)
        top = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        cols = tl.arange(0, BLOCK_N)
        for j in range(0, last):
            kpos = j * BLOCK_N + cols
            kmask = (kpos[:, None] < L) & (d[None, :] < D)
            k = tl.load(k_ptr + r.to(tl.int64) * sk_r + h * sk_h + kpos[:, None] * sk_l + d[None, :], mask=kmask,
                        other=0.0)
            v = tl.load(v_ptr + r.to(tl.int64) * sv_r + h * sv_h + kpos[:, None] * sv_l + d[None, :], mask=kmask,
                        other=0.0)
            if WIDEN:
                k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
            new_top = tl.maximum(top, tl.max(s, axis=1))
            alpha = tl.exp(top - new_top)
            p = tl.exp(s - new_top[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            top = new_top
        out = acc / total[:, None]
        tl.store(out_ptr + r.to(tl.int64) * so_r + h * so_h + rows[:, None] * so_m + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None] & (d[None, :] < D))

    return exact_attention


def attention_usable(q: torch.Tensor) -> bool:
    """`attention` takes `q`: bf16/fp16 on CUDA, head dim <= 256, Triton there (tests run the kernel on CPU
    tensors under Triton's interpreter by calling `attention` directly)."""
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256 and _attention_kernel() is not None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, scale: float,
              key_block: int, query_tile: int) -> torch.Tensor:
    """`ops.attention`'s forward in one kernel: q [R, KV, M, D], k/v [R, KV, L, D] (last axis contiguous),
    qpos [R, M] -> [R, KV, M, D] in q's dtype."""
    r, kv, m, d = q.shape
    length = k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    qpos = qpos.to(torch.int32).contiguous()
    out = torch.empty((r, kv, m, d), dtype=q.dtype, device=q.device)
    if r and m:
        grid = (r * kv, -(-m // query_tile))
        _attention_kernel()[grid](q, k, v, qpos, out, m, length, kv, float(scale),
                                  q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                                  v.stride(0), v.stride(1), v.stride(2), qpos.stride(0),
                                  out.stride(0), out.stride(1), out.stride(2),
                                  D=d, BLOCK_D=max(16, 1 << max(d - 1, 0).bit_length()), BLOCK_M=query_tile,
                                  BLOCK_N=key_block, WIDEN=not q.is_cuda, num_warps=ATTN_WARPS)
    return out


# -- RMSNorm ------------------------------------------------------------------------------------------------
# One program per row, the whole row in one block: the mean square's reduction order is fixed by the block
# width alone (the same compiled kernel for every row of every call), so it is batch-invariant too.
@functools.lru_cache(maxsize=1)
def _rms_kernel() -> Any:
    if os.environ.get("TURNRL_EXACT_TRITON", "1") == "0":
        return None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def exact_rms_norm(x_ptr, w_ptr, out_ptr, n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * n + c, mask=c < n, other=0.0)
        h = x.to(tl.float32)
        mean_square = tl.sum(h * h, axis=0) / n
        h = h * tl.math.rsqrt(mean_square + eps)
        w = tl.load(w_ptr + c, mask=c < n, other=0.0)
        y = w.to(tl.float32) * h.to(x.dtype).to(tl.float32)
        tl.store(out_ptr + row * n + c, y.to(out_ptr.dtype.element_ty), mask=c < n)

    return exact_rms_norm


def rms_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and 0 < x.shape[-1] <= MAX_WIDTH and _rms_kernel() is not None)


def _rms_launch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    flat = x.reshape(-1, n).contiguous()
    out = torch.empty_like(flat)
    if flat.shape[0]:
        _rms_kernel()[(flat.shape[0],)](flat, weight.contiguous(), out, n, float(eps),
                                        BLOCK=1 << max(n - 1, 0).bit_length(), num_warps=4)
    return out.reshape(x.shape)


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same function in plain torch ops (the gradient's recomputation)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _rms_launch(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xd, wd = x.detach().requires_grad_(), weight.detach().requires_grad_()
            gx, gw = torch.autograd.grad(plain_rms_norm(xd, wd, ctx.eps), (xd, wd), grad)
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`ops.rms_norm` on CUDA in one kernel (`rms_usable`), differentiable."""
    return _RMSNorm.apply(x, weight, eps)
