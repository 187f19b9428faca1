"""The Triton kernels of `turnrl.train.fused_projections`: rotary embedding and SwiGLU over one fused GEMM's output.

Imported only when those kernels are first used: importing it needs Triton. Each is one memory-bound pass that
reads the fused projection's output (or the gradients of what it fed) and writes the next tensors whole, so no
`cat` or `split` is left for the compiler to lower. They round where eager bf16 torch rounds (each product,
each sum: `swiglu_triton._round`), so given the same GEMM outputs they give eager's bits; WIDEN marks the
interpreter (CPU tensors), where rounding to bf16 is done on the bits.
"""

import triton
import triton.language as tl

from turnrl.train.swiglu_triton import _down_back_epilogue, _round, _silu


@triton.jit
def _head_rows(T, BLOCK_T: tl.constexpr, HALF: tl.constexpr, HEADS_FIRST: tl.constexpr):
    """(head, tokens, half-head columns, live tokens) of this program's block of one head. HEADS_FIRST: the heads
    on the grid's first axis, so the programs of one block of tokens run side by side (their cos and sin are the
    same rows)."""
    if HEADS_FIRST:
        head, block = tl.program_id(0), tl.program_id(1)
    else:
        head, block = tl.program_id(1), tl.program_id(0)
    rows = block * BLOCK_T + tl.arange(0, BLOCK_T)
    return head, rows, tl.arange(0, HALF), rows[:, None] < T


@triton.jit
def _angles(cos_ptr, sin_ptr, rows, cols, live, D: tl.constexpr, HALF: tl.constexpr):
    """cos and sin of both halves of the head (float32), [BLOCK_T, HALF] each."""
    at = rows[:, None].to(tl.int64) * D + cols[None, :]
    c1 = tl.load(cos_ptr + at, mask=live, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + at + HALF, mask=live, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + at, mask=live, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + at + HALF, mask=live, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def rotary_split(y_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, T, H: tl.constexpr, KV: tl.constexpr,
                 D: tl.constexpr, BLOCK_T: tl.constexpr, WIDEN: tl.constexpr, HEADS_FIRST: tl.constexpr = False):
    """y [T, (H + 2 KV) D] (q | k | v heads) -> q [T, H, D] and k [T, KV, D] rotated, v [T, KV, D] copied. One
    program: BLOCK_T tokens of one head (the head axis: q heads, then k heads, then v heads).
    x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): each product and the sum rounded."""
    HALF: tl.constexpr = D // 2
    W: tl.constexpr = (H + 2 * KV) * D
    head, rows, cols, live = _head_rows(T, BLOCK_T, HALF, HEADS_FIRST)
    src = y_ptr + rows[:, None].to(tl.int64) * W + head * D + cols[None, :]
    x1 = tl.load(src, mask=live, other=0.0)
    x2 = tl.load(src + HALF, mask=live, other=0.0)
    if head < H + KV:
        c1, c2, s1, s2 = _angles(cos_ptr, sin_ptr, rows, cols, live, D, HALF)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        dtype = y_ptr.dtype.element_ty
        o1 = _round(_round(a1 * c1, dtype, WIDEN).to(tl.float32) - _round(a2 * s1, dtype, WIDEN).to(tl.float32),
                    dtype, WIDEN)
        o2 = _round(_round(a2 * c2, dtype, WIDEN).to(tl.float32) + _round(a1 * s2, dtype, WIDEN).to(tl.float32),
                    dtype, WIDEN)
        if head < H:
            dst = q_ptr + rows[:, None].to(tl.int64) * (H * D) + head * D + cols[None, :]
        else:
            dst = k_ptr + rows[:, None].to(tl.int64) * (KV * D) + (head - H) * D + cols[None, :]
        tl.store(dst, o1, mask=live)
        tl.store(dst + HALF, o2, mask=live)
    else:
        dst = v_ptr + rows[:, None].to(tl.int64) * (KV * D) + (head - H - KV) * D + cols[None, :]
        tl.store(dst, x1, mask=live)
        tl.store(dst + HALF, x2, mask=live)


@triton.jit
def rotary_merge(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, dy_ptr, T, H: tl.constexpr, KV: tl.constexpr,
                 D: tl.constexpr, BLOCK_T: tl.constexpr, WIDEN: tl.constexpr, HEADS_FIRST: tl.constexpr = False):
    """The gradient of `rotary_split`: dq, dk (of the rotated heads) and dv -> dy [T, (H + 2 KV) D], in autograd's
    order: d1 = g1 cos1 + g2 sin2, d2 = g2 cos2 - g1 sin1, each product and the sum rounded."""
    HALF: tl.constexpr = D // 2
    W: tl.constexpr = (H + 2 * KV) * D
    head, rows, cols, live = _head_rows(T, BLOCK_T, HALF, HEADS_FIRST)
    dst = dy_ptr + rows[:, None].to(tl.int64) * W + head * D + cols[None, :]
    if head < H + KV:
        if head < H:
            src = dq_ptr + rows[:, None].to(tl.int64) * (H * D) + head * D + cols[None, :]
        else:
            src = dk_ptr + rows[:, None].to(tl.int64) * (KV * D) + (head - H) * D + cols[None, :]
        g1 = tl.load(src, mask=live, other=0.0).to(tl.float32)
        g2 = tl.load(src + HALF, mask=live, other=0.0).to(tl.float32)
        c1, c2, s1, s2 = _angles(cos_ptr, sin_ptr, rows, cols, live, D, HALF)
        dtype = dy_ptr.dtype.element_ty
        d1 = _round(_round(g1 * c1, dtype, WIDEN).to(tl.float32) + _round(g2 * s2, dtype, WIDEN).to(tl.float32),
                    dtype, WIDEN)
        d2 = _round(_round(g2 * c2, dtype, WIDEN).to(tl.float32) - _round(g1 * s1, dtype, WIDEN).to(tl.float32),
                    dtype, WIDEN)
        tl.store(dst, d1, mask=live)
        tl.store(dst + HALF, d2, mask=live)
    else:
        src = dv_ptr + rows[:, None].to(tl.int64) * (KV * D) + (head - H - KV) * D + cols[None, :]
        tl.store(dst, tl.load(src, mask=live, other=0.0), mask=live)
        tl.store(dst + HALF, tl.load(src + HALF, mask=live, other=0.0), mask=live)


@triton.jit
def _tile(T, N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """(tokens, columns, mask) of this program's [BLOCK_T, BLOCK_N] tile of a [T, N] tensor."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, (rows[:, None] < T) & (cols[None, :] < N)


@triton.jit
def swiglu(y_ptr, h_ptr, T, N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, WIDEN: tl.constexpr):
    """y [T, 2N] = (g | u) -> h [T, N] = silu(g) * u, SiLU's output and the product rounded."""
    rows, cols, live = _tile(T, N, BLOCK_T, BLOCK_N)
    at = rows[:, None].to(tl.int64) * (2 * N) + cols[None, :]
    g = tl.load(y_ptr + at, mask=live, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + at + N, mask=live, other=0.0).to(tl.float32)
    dtype = h_ptr.dtype.element_ty
    h = _round(_round(_silu(g), dtype, WIDEN).to(tl.float32) * u, dtype, WIDEN)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], h, mask=live)


@triton.jit
def swiglu_back(dh_ptr, y_ptr, dy_ptr, T, N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                WIDEN: tl.constexpr):
    """The gradient of `swiglu`: dh [T, N] and the forward's y -> dy [T, 2N] = (dg | du), in the unfused graph's
    order of operations and roundings (`swiglu_triton._down_back_epilogue`)."""
    rows, cols, live = _tile(T, N, BLOCK_T, BLOCK_N)
    at = rows[:, None].to(tl.int64) * (2 * N) + cols[None, :]
    g = tl.load(y_ptr + at, mask=live, other=0.0)
    u = tl.load(y_ptr + at + N, mask=live, other=0.0)
    dh = tl.load(dh_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=live, other=0.0).to(tl.float32)
    dg, du = _down_back_epilogue(dh, g, u, dy_ptr.dtype.element_ty, WIDEN)
    tl.store(dy_ptr + at, dg, mask=live)
    tl.store(dy_ptr + at + N, du, mask=live)
