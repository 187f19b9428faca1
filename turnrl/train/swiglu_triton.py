"""The Triton kernels of `turnrl.train.swiglu_kernel` (a SwiGLU MLP's GEMMs with the activation in their epilogue).

Imported only when those kernels are first used: importing it needs Triton. `swiglu_kernel` explains what they
fuse and holds the blocking. The epilogues round where the unfused graph rounds (each GEMM's output to the
weights' dtype, SiLU's output, each product), so given the same GEMM outputs they give the same bits; WIDEN is
the interpreter's float32 widening of bf16/fp16 dots.
"""

import triton
import triton.language as tl


@triton.jit
def _offsets(M, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(first row, first column) of this program's tile: GROUP_M row blocks sweep the columns together, so a
    group's rows and the weights' columns stay in L2 while its programs run."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n: tl.constexpr = N // BLOCK_N
    width = GROUP_M * n_n
    first = (pid // width) * GROUP_M
    size = tl.minimum(n_m - first, GROUP_M)
    return (first + (pid % width) % size) * BLOCK_M, ((pid % width) // size) * BLOCK_N


@triton.jit
def _tile(M, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          GROUP_M: tl.constexpr):
    """(rows, columns, depth offsets, rows inside M) of this program's tile (`_offsets`)."""
    first_row, first_col = _offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = first_row + tl.arange(0, BLOCK_M)
    return rows, first_col + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K), rows[:, None] < M


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
def _gate_up_epilogue(acc_g, acc_u, dtype: tl.constexpr, WIDEN: tl.constexpr):
    """(g, u, h = silu(g) * u) in `dtype` from the float32 accumulators, rounded as the unfused graph rounds."""
    g = _round(acc_g, dtype, WIDEN)
    u = _round(acc_u, dtype, WIDEN)
    s = _round(_silu(g.to(tl.float32)), dtype, WIDEN)
    return g, u, _round(s.to(tl.float32) * u.to(tl.float32), dtype, WIDEN)


@triton.jit
def _down_back_epilogue(acc, g, u, dtype: tl.constexpr, WIDEN: tl.constexpr):
    """(dg, du) in `dtype` from dh's float32 accumulator and the forward's g and u, in the unfused graph's order
    of operations and roundings."""
    g = g.to(tl.float32)
    dh = _round(acc, dtype, WIDEN).to(tl.float32)
    du = _round(dh * _round(_silu(g), dtype, WIDEN).to(tl.float32), dtype, WIDEN)
    dhu = _round(dh * u.to(tl.float32), dtype, WIDEN).to(tl.float32)
    sig = tl.sigmoid(g)
    return _round(dhu * sig * (g * (1.0 - sig) + 1.0), dtype, WIDEN), du


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
    g, u, h = _gate_up_epilogue(acc_g, acc_u, g_ptr.dtype.element_ty, WIDEN)
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
    at = rows[:, None].to(tl.int64) * N + cols[None, :]
    g = tl.load(g_ptr + at, mask=inside, other=0.0)
    u = tl.load(u_ptr + at, mask=inside, other=0.0)
    dg, du = _down_back_epilogue(acc, g, u, dgu_ptr.dtype.element_ty, WIDEN)
    out = rows[:, None].to(tl.int64) * (2 * N) + cols[None, :]
    tl.store(dgu_ptr + out, dg, mask=inside)
    tl.store(dgu_ptr + out + N, du, mask=inside)


@triton.jit
def gate_up_tma(x_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc, M, N: tl.constexpr, K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                WIDEN: tl.constexpr):
    """`gate_up` with its tiles moved by tensor descriptors (TMA on Hopper): rows past M load as zeros and are
    not stored."""
    first_row, first_col = _offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([first_row, k])
        wg = wg_desc.load([first_col, k])
        wu = wu_desc.load([first_col, k])
        if WIDEN:
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(x, wg.T, acc_g)
        acc_u = tl.dot(x, wu.T, acc_u)
    g, u, h = _gate_up_epilogue(acc_g, acc_u, g_desc.dtype, WIDEN)
    g_desc.store([first_row, first_col], g)
    u_desc.store([first_row, first_col], u)
    h_desc.store([first_row, first_col], h)


@triton.jit
def down_back_tma(dy_desc, wd_desc, g_desc, u_desc, dgu_desc, M, N: tl.constexpr, K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  WIDEN: tl.constexpr):
    """`down_back` with its tiles moved by tensor descriptors (TMA on Hopper)."""
    first_row, first_col = _offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        dy = dy_desc.load([first_row, k])
        w = wd_desc.load([k, first_col])
        if WIDEN:
            dy, w = dy.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(dy, w, acc)
    dg, du = _down_back_epilogue(acc, g_desc.load([first_row, first_col]), u_desc.load([first_row, first_col]),
                                 dgu_desc.dtype, WIDEN)
    dgu_desc.store([first_row, first_col], dg)
    dgu_desc.store([first_row, N + first_col], du)
