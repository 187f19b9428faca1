"""The Triton kernels of `turnrl.train.swiglu_kernel` (a SwiGLU MLP's GEMMs with the activation in their epilogue).

Imported only when those kernels are first used: importing it needs Triton. `swiglu_kernel` explains what they
fuse and holds the blocking. The epilogues round where the unfused graph rounds (each GEMM's output to the
weights' dtype, SiLU's output, each product), so given the same GEMM outputs they give the same bits; WIDEN is
the interpreter's float32 widening of bf16/fp16 dots.
"""

import triton
import triton.language as tl


@triton.jit
def _tile(M, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          GROUP_M: tl.constexpr):
    """(rows, columns, depth offsets, rows inside M) of this program's tile: GROUP_M row blocks sweep the columns
    together, so a group's rows and the weights' columns stay in L2 while its programs run."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n: tl.constexpr = N // BLOCK_N
    width = GROUP_M * n_n
    first = (pid // width) * GROUP_M
    size = tl.minimum(n_m - first, GROUP_M)
    rows = (first + (pid % width) % size) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = ((pid % width) // size) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, tl.arange(0, BLOCK_K), rows[:, None] < M


@triton.jit
def _silu(g):
    """SiLU of float32 `g` as inductor's decomposition computes it: g / (1 + exp(-g))."""
    return g / (1.0 + tl.exp(-g))


@triton.jit
def _round(x, dtype: tl.constexpr, WIDEN: tl.constexpr):
    """float32 `x` to `dtype`, rounded to nearest even. Triton's interpreter truncates to bf16, so there the
    rounding is done on the bits first (compiled kernels round in the conversion)."""
    if WIDEN and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def gate_up(x_ptr, wg_ptr, wu_ptr, g_ptr, u_ptr, h_ptr, M, N: tl.constexpr, K: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
            WIDEN: tl.constexpr):
    """g = x wg^T, u = x wu^T (x [M, K], wg and wu [N, K]) and h = silu(g) * u, each [M, N]: one program a
    BLOCK_M x BLOCK_N tile of all three, x's tile read once for both dots."""
    rows, cols, ks, inside = _tile(M, N, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    x_at = x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    w_at = cols[None, :] * K + ks[:, None]            # [BLOCK_K, BLOCK_N]: the weights' rows as columns
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_at + k, mask=inside, other=0.0)
        wg = tl.load(wg_ptr + w_at + k)
        wu = tl.load(wu_ptr + w_at + k)
        if WIDEN:
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(x, wg, acc_g)
        acc_u = tl.dot(x, wu, acc_u)
    dtype: tl.constexpr = g_ptr.dtype.element_ty
    g = _round(acc_g, dtype, WIDEN)
    u = _round(acc_u, dtype, WIDEN)
    s = _round(_silu(g.to(tl.float32)), dtype, WIDEN)
    h = _round(s.to(tl.float32) * u.to(tl.float32), dtype, WIDEN)
    out = rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(g_ptr + out, g, mask=inside)
    tl.store(u_ptr + out, u, mask=inside)
    tl.store(h_ptr + out, h, mask=inside)


@triton.jit
def down_back(dy_ptr, wd_ptr, g_ptr, u_ptr, dgu_ptr, M, N: tl.constexpr, K: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
              WIDEN: tl.constexpr):
    """The MLP's backward from dy [M, K] to its gate and up projections: dh = dy wd (wd [K, N]), then
    dg = dh * u * silu'(g) and du = dh * silu(g) into dgu [M, 2N] (dg in the first N columns, du after), in the
    unfused graph's order of operations; dh never leaves the registers."""
    rows, cols, ks, inside = _tile(M, N, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    dy_at = dy_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    w_at = wd_ptr + ks[:, None] * N + cols[None, :]    # [BLOCK_K, BLOCK_N] of wd's rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        dy = tl.load(dy_at + k, mask=inside, other=0.0)
        w = tl.load(w_at + k * N)
        if WIDEN:
            dy, w = dy.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(dy, w, acc)
    dtype: tl.constexpr = dgu_ptr.dtype.element_ty
    at = rows[:, None].to(tl.int64) * N + cols[None, :]
    g = tl.load(g_ptr + at, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + at, mask=inside, other=0.0).to(tl.float32)
    dh = _round(acc, dtype, WIDEN).to(tl.float32)
    du = _round(dh * _round(_silu(g), dtype, WIDEN).to(tl.float32), dtype, WIDEN)
    dhu = _round(dh * u, dtype, WIDEN).to(tl.float32)
    sig = tl.sigmoid(g)
    dg = _round(dhu * sig * (g * (1.0 - sig) + 1.0), dtype, WIDEN)
    out = rows[:, None].to(tl.int64) * (2 * N) + cols[None, :]
    tl.store(dgu_ptr + out, dg, mask=inside)
    tl.store(dgu_ptr + out + N, du, mask=inside)
