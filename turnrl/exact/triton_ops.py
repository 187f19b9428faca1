"""The exact mode's layer kernels on CUDA: attention, RMSNorm, the weight products, SiLU(gate) * up and rotary,
each batch-invariant (a row's bits do not depend on the other rows of a call), and called by the engine and the
trainer alike so that both sides agree.

`attention`: one program per (row, key/value head, tile of 16 queries) reads keys in blocks of `KEY_BLOCK` at
absolute positions 0, 64, ... in order with an online softmax; a block the tile cannot see is skipped, which
is an exact no-op, so a query's result is the same in prefill, in a one-token decode step over any cache
length, and in the trainer's pass.

`rms_norm`: one program per row with `tl.sum`, whose order is fixed by the row width and the launch constants
alone. A fused RMSNorm built on the pairwise tree (`triton_tree`) was tried and left out: Triton 3.6 took over
two minutes to compile it for a 1024-wide bf16 row (in LLVM lowering of the tree's reshapes); the trainer calls
the same kernel, so the two sides agree without it matching the tree.

`TURNRL_EXACT_TRITON=0` turns these off, and the pairwise trees too (to measure what they save).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from turnrl.exact.triton_build import MAX_WIDTH, kernel_builder, pow2

# -- attention ----------------------------------------------------------------------------------------------
# One program per (row, key/value head, tile of QUERY_TILE queries); keys in blocks of KEY_BLOCK at absolute
# positions, in order 0, 1, ...: an online softmax whose running max, sum and output a query updates block by
# block. A block a query cannot see changes nothing exactly (max unchanged, scale exp(0) = 1, weights 0), so a
# query's bits depend on its own position, queries and keys only: not on which other queries share its tile
# (tensor-core rows are independent), how many blocks the tile visits, or the cache length. Every call uses
# the same compiled kernel (the same tile shapes and warps), so prefill, decode and the trainer's pass agree.
ATTN_WARPS = 4


@kernel_builder
def _attention_kernel(triton: Any, tl: Any) -> Any:

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
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256
            and _attention_kernel() is not None)


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
                                  D=d, BLOCK_D=pow2(d, 16), BLOCK_M=query_tile,
                                  BLOCK_N=key_block, WIDEN=not q.is_cuda, num_warps=ATTN_WARPS)
    return out


# -- RMSNorm ------------------------------------------------------------------------------------------------
# One program per row, the whole row in one block: the mean square's reduction order is fixed by the block
# width alone (the same compiled kernel for every row of every call), so it is batch-invariant too.
@kernel_builder
def _rms_kernel(triton: Any, tl: Any) -> Any:

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
                                        BLOCK=pow2(n), num_warps=4)
    return out.reshape(x.shape)


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same function in plain torch ops (the gradient's recomputation)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class _PlainGradient(torch.autograd.Function):
    """forward: `fast(*tensors)` (a kernel); backward: the gradient of `plain(*tensors)`, the same function in
    plain torch ops, recomputed (gradients need no bitwise agreement with anything)."""

    @staticmethod
    def forward(ctx: Any, fast: Any, plain: Any, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        ctx.plain = plain
        return fast(*tensors)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        tensors = ctx.saved_tensors
        wanted = [i for i, t in enumerate(tensors) if ctx.needs_input_grad[i + 2]]
        grads: list[torch.Tensor | None] = [None] * len(tensors)
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(i in wanted) for i, t in enumerate(tensors)]
            found = torch.autograd.grad(ctx.plain(*inputs), [inputs[i] for i in wanted], grad)
        for i, g in zip(wanted, found):
            grads[i] = g
        return (None, None, *grads)


def with_plain_gradient(fast: Any, plain: Any, *tensors: torch.Tensor) -> torch.Tensor:
    """`fast(*tensors)`, differentiable through `plain` where any input needs a gradient."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _PlainGradient.apply(fast, plain, *tensors)
    return fast(*tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`ops.rms_norm` on CUDA in one kernel (`rms_usable`), differentiable."""
    return with_plain_gradient(functools.partial(_rms_launch, eps=eps), functools.partial(plain_rms_norm, eps=eps),
                               x, weight)


# -- matmul -------------------------------------------------------------------------------------------------
# x [M, K] @ w[N, K].T in one launch of one compiled kernel: every output tile is one program that walks K in
# blocks of MM_BLOCK_K from 0 upward, accumulating in float32 on the tensor cores, no split-K. The blocking
# (tile shapes, warps, stages) is fixed, never chosen from M, so a row's result depends only on its own values
# and the weight: the same bits in a prompt's prefill (M = tokens), a decode step (M = batch) and the
# trainer's pass (M = tokens of a mini-batch). This replaces the fixed-shape library GEMM per 128-row tile,
# whose one launch per tile made a 65k-token exact prefill cost ~49k launches.
MM_BLOCK_M, MM_BLOCK_N, MM_BLOCK_K, MM_GROUP_M, MM_WARPS, MM_STAGES = 64, 128, 64, 8, 4, 3


@kernel_builder
def _matmul_kernel(triton: Any, tl: Any) -> Any:

    @triton.jit
    def exact_matmul(x_ptr, w_ptr, out_ptr, M, N, K, sx_m, sw_n, so_m, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, WIDEN: tl.constexpr):
        # grouped order (GROUP_M row tiles share each column tile in turn) for cache reuse; it decides only
        # which program computes a tile, never how
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        size_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
        pid_n = (pid % (GROUP_M * tiles_n)) // size_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx_m + kk[None, :],
                        mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + cols[:, None].to(tl.int64) * sw_n + kk[None, :],
                        mask=(cols[:, None] < N) & (kk[None, :] < K), other=0.0)
            if WIDEN:   # the interpreter's bf16/fp16 dots are wrong: widen there (tests)
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * so_m + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    return exact_matmul


def matmul_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`matmul` takes x and weight: bf16/fp16 on CUDA, the same dtype, Triton there."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and _matmul_kernel() is not None)


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N] in x's dtype, batch-invariant (see above)."""
    m, k = x.shape
    n = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        grid = (-(-m // MM_BLOCK_M) * -(-n // MM_BLOCK_N),)
        _matmul_kernel()[grid](x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                               BLOCK_M=MM_BLOCK_M, BLOCK_N=MM_BLOCK_N, BLOCK_K=MM_BLOCK_K, GROUP_M=MM_GROUP_M,
                               WIDEN=not x.is_cuda, num_warps=MM_WARPS, num_stages=MM_STAGES)
    return out


# -- elementwise: SiLU(gate) * up, rotary ---------------------------------------------------------------------
# Elementwise results are batch-invariant anyway; these are one launch each instead of the five to eight small
# ones of the plain torch expressions (which a decode step runs per layer). Both sides call them, so the
# engine and the trainer agree on their bits; the gradients are the plain expressions' (`ops`).
ELEMENTWISE_BLOCK = 1024


@kernel_builder
def _elementwise_kernels(triton: Any, tl: Any) -> Any:

    @triton.jit
    def exact_silu_mul(g_ptr, u_ptr, out_ptr, width, sg, su, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        g = tl.load(g_ptr + row * sg + c, mask=c < width, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + c, mask=c < width, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * width + c, y.to(out_ptr.dtype.element_ty), mask=c < width)

    @triton.jit
    def exact_rope(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, sx_t, sx_h, sc_t, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        # one token: x [heads, 2 * HALF] (row stride sx_h), cos/sin [2 * HALF]
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        live = (h[:, None] < heads) & (d[None, :] < HALF)
        base = x_ptr + t * sx_t + h[:, None] * sx_h + d[None, :]
        lo = tl.load(base, mask=live, other=0.0).to(tl.float32)
        hi = tl.load(base + HALF, mask=live, other=0.0).to(tl.float32)
        c_lo = tl.load(cos_ptr + t * sc_t + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        c_hi = tl.load(cos_ptr + t * sc_t + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        s_lo = tl.load(sin_ptr + t * sc_t + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        s_hi = tl.load(sin_ptr + t * sc_t + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + t * heads * 2 * HALF + h[:, None] * 2 * HALF + d[None, :]
        tl.store(out, (lo * c_lo - hi * s_lo).to(out_ptr.dtype.element_ty), mask=live)
        tl.store(out + HALF, (hi * c_hi + lo * s_hi).to(out_ptr.dtype.element_ty), mask=live)

    return exact_silu_mul, exact_rope


def elementwise_usable(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _elementwise_kernels() is not None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with a unit last stride (a view where the layout allows)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up (same shape; rows may be strided views, e.g. the halves of a stacked projection)."""
    g, u = _rows(gate), _rows(up)
    rows, width = g.shape
    out = torch.empty((rows, width), dtype=gate.dtype, device=gate.device)
    if rows and width:
        grid = (rows, -(-width // ELEMENTWISE_BLOCK))
        _elementwise_kernels()[0][grid](g, u, out, width, g.stride(0), u.stride(0), BLOCK=ELEMENTWISE_BLOCK,
                                        num_warps=4)
    return out.reshape(gate.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, D] rotated by cos/sin [..., 1, D] (broadcast over the leading axes), in fp32, rounded once."""
    *lead, heads, d = x.shape
    tokens = x.reshape(-1, heads, d)
    if tokens.stride(-1) != 1:
        tokens = tokens.contiguous()
    n = tokens.shape[0]
    c = cos.expand(*lead, 1, d).reshape(n, d).contiguous()
    s = sin.expand(*lead, 1, d).reshape(n, d).contiguous()
    out = torch.empty((n, heads, d), dtype=x.dtype, device=x.device)
    if n:
        _elementwise_kernels()[1][(n,)](tokens, c, s, out, heads, tokens.stride(0), tokens.stride(1), c.stride(0),
                                        HALF=d // 2, BLOCK_H=pow2(heads),
                                        BLOCK_D=pow2(d // 2, 16), num_warps=4)
    return out.reshape(x.shape)
