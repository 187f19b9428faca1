"""The Triton kernels of `turnrl.train.flash_kernel` (causal attention over packed rows, forward and backward).

Imported only when those kernels are first used: importing it needs Triton (the CUDA builds of torch ship it;
on CPUs only Triton's interpreter runs them, for tests). `flash_kernel` explains the algorithm and holds the
blocking; WIDEN is the interpreter's float32 widening of bf16/fp16 dots.
"""

import triton
import triton.language as tl


@triton.jit
def _query_program(cu_ptr, n_blocks, BLOCK_M: tl.constexpr, ACROSS: tl.constexpr):
    """A query program's (head, segment start, segment length, first query): the longest blocks first, so the
    short programs fill the tail of the grid. ACROSS: grid (segment, head, block), the last query blocks of
    every segment first; else (block, head, segment), longest first within each segment only."""
    seg = tl.program_id(0) if ACROSS else tl.program_id(2)
    block = tl.program_id(2) if ACROSS else tl.program_id(0)
    start = tl.load(cu_ptr + seg)
    return tl.program_id(1), start, tl.load(cu_ptr + seg + 1) - start, (n_blocks - 1 - block) * BLOCK_M


@triton.jit
def _key_block(k_seg, v_seg, j, d, L, KV_STRIDE: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
               WIDEN: tl.constexpr):
    """Keys and values [j, j + BLOCK_N) of a segment (zeros past its length L where MASKED), their positions."""
    cols = j + tl.arange(0, BLOCK_N)
    at = cols[:, None] * KV_STRIDE + d[None, :]
    if MASKED:
        k = tl.load(k_seg + at, mask=cols[:, None] < L, other=0.0)
        v = tl.load(v_seg + at, mask=cols[:, None] < L, other=0.0)
    else:
        k = tl.load(k_seg + at)
        v = tl.load(v_seg + at)
    if WIDEN:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return cols, k, v


@triton.jit
def _forward_block(q, acc, top, total, k_seg, v_seg, j, rows, d, scale2, L, KV_STRIDE: tl.constexpr,
                   MASKED: tl.constexpr, BLOCK_N: tl.constexpr, WIDEN: tl.constexpr):
    cols, k, v = _key_block(k_seg, v_seg, j, d, L, KV_STRIDE, MASKED, BLOCK_N, WIDEN)
    s = tl.dot(q, tl.trans(k)) * scale2
    if MASKED:
        s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    new_top = tl.maximum(top, tl.max(s, axis=1))
    alpha = tl.exp2(top - new_top)
    p = tl.exp2(s - new_top[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, new_top, total


@triton.jit
def forward(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_ptr, N, n_blocks, scale2, H: tl.constexpr,
            KV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            WIDEN: tl.constexpr, ACROSS: tl.constexpr):
    h, start, L, m0 = _query_program(cu_ptr, n_blocks, BLOCK_M, ACROSS)
    if m0 < L:
        kh = h // (H // KV)
        rows = m0 + tl.arange(0, BLOCK_M)
        d = tl.arange(0, D)
        live = rows < L
        q_at = rows[:, None] * (H * D) + d[None, :]          # within the segment's (token, head h) rows
        q_seg = q_ptr + start.to(tl.int64) * (H * D) + h * D
        q = tl.load(q_seg + q_at, mask=live[:, None], other=0.0)
        if WIDEN:
            q = q.to(tl.float32)
        top = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        k_seg = k_ptr + start.to(tl.int64) * (KV * D) + kh * D
        v_seg = v_ptr + start.to(tl.int64) * (KV * D) + kh * D
        for j in range(0, m0, BLOCK_N):                 # keys every query of the block sees
            acc, top, total = _forward_block(q, acc, top, total, k_seg, v_seg, j, rows, d, scale2, L, KV * D,
                                             False, BLOCK_N, WIDEN)
        for j in range(m0, tl.minimum(m0 + BLOCK_M, L), BLOCK_N):   # the diagonal
            acc, top, total = _forward_block(q, acc, top, total, k_seg, v_seg, j, rows, d, scale2, L, KV * D,
                                             True, BLOCK_N, WIDEN)
        o_seg = o_ptr + start.to(tl.int64) * (H * D) + h * D
        tl.store(o_seg + q_at, (acc / total[:, None]).to(o_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(lse_ptr + h * N + start + rows, top + tl.log2(total), mask=live)


@triton.jit
def delta(o_ptr, do_ptr, delta_ptr, N, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)          # flat (token, head) index
    d = tl.arange(0, D)
    live = rows < N * H
    at = rows.to(tl.int64)[:, None] * D + d[None, :]
    o = tl.load(o_ptr + at, mask=live[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + at, mask=live[:, None], other=0.0).to(tl.float32)
    tok, h = rows // H, rows % H
    tl.store(delta_ptr + h * N + tok, tl.sum(o * do, axis=1), mask=live)


@triton.jit
def _keys_block(k, v, dk, dv, q_seg, do_seg, lse_seg, delta_seg, dq_seg, i, cols, d, L, scale, scale2,
                H: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr, BLOCK_M: tl.constexpr,
                WIDEN: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    rows = i + tl.arange(0, BLOCK_M)
    live = rows < L
    at = rows[:, None] * (H * D) + d[None, :]
    q = tl.load(q_seg + at, mask=live[:, None], other=0.0)
    do = tl.load(do_seg + at, mask=live[:, None], other=0.0)
    lse = tl.load(lse_seg + rows, mask=live, other=float("inf"))
    dl = tl.load(delta_seg + rows, mask=live, other=0.0)
    if WIDEN:
        q, do = q.to(tl.float32), do.to(tl.float32)
    s = tl.dot(k, tl.trans(q))                                            # [keys, queries]
    dp = tl.dot(v, tl.trans(do))   # before dV's dot: Triton waits for every dot whose result is used at
    #                                once, and a wait after dV's dot would hold the step until it is done too
    p = tl.exp2(s * scale2 - lse[None, :])
    if MASKED:
        p = tl.where(cols[:, None] <= rows[None, :], p, 0.0)
    dv += tl.dot(p.to(do.dtype), do)
    ds = p * (dp - dl[None, :])
    dk += tl.dot(ds.to(q.dtype), q)
    if ATOMIC_DQ:   # this key block's share of dQ, added into a float32 buffer (order varies run to run)
        tl.atomic_add(dq_seg + at, tl.dot(tl.trans(ds.to(k.dtype)), k) * scale, mask=live[:, None])
    return dk, dv


@triton.jit
def keys(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_ptr, cu_ptr, N, scale, scale2,
         H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
         WIDEN: tl.constexpr, ATOMIC_DQ: tl.constexpr, ACROSS: tl.constexpr, FLAT: tl.constexpr):
    # the first key blocks see the most queries: first (ACROSS: grid (segment, head, block), the first blocks of
    # every segment before any second block; else (block, head, segment), first within each segment only)
    n0 = (tl.program_id(2) if ACROSS else tl.program_id(0)) * BLOCK_N
    kh = tl.program_id(1)
    seg = tl.program_id(0) if ACROSS else tl.program_id(2)
    start = tl.load(cu_ptr + seg)
    L = tl.load(cu_ptr + seg + 1) - start
    if n0 < L:
        cols = n0 + tl.arange(0, BLOCK_N)
        d = tl.arange(0, D)
        live = cols < L
        kv_at = cols[:, None] * (KV * D) + d[None, :]
        kv_off = start.to(tl.int64) * (KV * D) + kh * D
        k = tl.load(k_ptr + kv_off + kv_at, mask=live[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off + kv_at, mask=live[:, None], other=0.0)
        if WIDEN:
            k, v = k.to(tl.float32), v.to(tl.float32)
        dk = tl.zeros((BLOCK_N, D), tl.float32)
        dv = tl.zeros((BLOCK_N, D), tl.float32)
        if FLAT:   # one loop over (query head of the group, query step), every step masked: one pipeline
            steps = tl.cdiv(L - n0, BLOCK_M)
            for t in range(0, (H // KV) * steps):
                g = t // steps
                h = kh * (H // KV) + g
                q_off = start.to(tl.int64) * (H * D) + h * D
                dk, dv = _keys_block(k, v, dk, dv, q_ptr + q_off, do_ptr + q_off, lse_ptr + h * N + start,
                                     delta_ptr + h * N + start, dq_ptr + q_off, n0 + (t - g * steps) * BLOCK_M, cols,
                                     d, L, scale, scale2, H, D, True, BLOCK_M, WIDEN, ATOMIC_DQ)
        else:      # per head, the diagonal steps (masked) and then the rest, each loop pipelined on its own
            diagonal_end = tl.minimum(n0 + BLOCK_N, L)
            for g in range(H // KV):
                h = kh * (H // KV) + g
                q_off = start.to(tl.int64) * (H * D) + h * D
                q_seg, do_seg, dq_seg = q_ptr + q_off, do_ptr + q_off, dq_ptr + q_off
                lse_seg, delta_seg = lse_ptr + h * N + start, delta_ptr + h * N + start
                for i in range(n0, diagonal_end, BLOCK_M):      # queries on the keys' diagonal (BLOCK_M | BLOCK_N)
                    dk, dv = _keys_block(k, v, dk, dv, q_seg, do_seg, lse_seg, delta_seg, dq_seg, i, cols, d, L,
                                         scale, scale2, H, D, True, BLOCK_M, WIDEN, ATOMIC_DQ)
                for i in range(diagonal_end, L, BLOCK_M):       # queries that see every key of the block
                    dk, dv = _keys_block(k, v, dk, dv, q_seg, do_seg, lse_seg, delta_seg, dq_seg, i, cols, d, L,
                                         scale, scale2, H, D, False, BLOCK_M, WIDEN, ATOMIC_DQ)
        tl.store(dk_ptr + kv_off + kv_at, (dk * scale).to(dk_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(dv_ptr + kv_off + kv_at, dv.to(dv_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit
def _queries_block(q, do, lse, dl, dq, k_seg, v_seg, j, rows, d, scale2, L, KV_STRIDE: tl.constexpr,
                   MASKED: tl.constexpr, BLOCK_N: tl.constexpr, WIDEN: tl.constexpr):
    cols, k, v = _key_block(k_seg, v_seg, j, d, L, KV_STRIDE, MASKED, BLOCK_N, WIDEN)
    p = tl.exp2(tl.dot(q, tl.trans(k)) * scale2 - lse[:, None])
    if MASKED:
        p = tl.where(cols[None, :] <= rows[:, None], p, 0.0)
    ds = p * (tl.dot(do, tl.trans(v)) - dl[:, None])
    dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def queries(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_ptr, N, n_blocks, scale, scale2,
            H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            WIDEN: tl.constexpr, ACROSS: tl.constexpr):
    h, start, L, m0 = _query_program(cu_ptr, n_blocks, BLOCK_M, ACROSS)
    if m0 < L:
        kh = h // (H // KV)
        rows = m0 + tl.arange(0, BLOCK_M)
        d = tl.arange(0, D)
        live = rows < L
        at = rows[:, None] * (H * D) + d[None, :]
        q_off = start.to(tl.int64) * (H * D) + h * D
        q = tl.load(q_ptr + q_off + at, mask=live[:, None], other=0.0)
        do = tl.load(do_ptr + q_off + at, mask=live[:, None], other=0.0)
        lse = tl.load(lse_ptr + h * N + start + rows, mask=live, other=float("inf"))
        dl = tl.load(delta_ptr + h * N + start + rows, mask=live, other=0.0)
        if WIDEN:
            q, do = q.to(tl.float32), do.to(tl.float32)
        dq = tl.zeros((BLOCK_M, D), tl.float32)
        k_seg = k_ptr + start.to(tl.int64) * (KV * D) + kh * D
        v_seg = v_ptr + start.to(tl.int64) * (KV * D) + kh * D
        for j in range(0, m0, BLOCK_N):
            dq = _queries_block(q, do, lse, dl, dq, k_seg, v_seg, j, rows, d, scale2, L, KV * D, False, BLOCK_N,
                                WIDEN)
        for j in range(m0, tl.minimum(m0 + BLOCK_M, L), BLOCK_N):
            dq = _queries_block(q, do, lse, dl, dq, k_seg, v_seg, j, rows, d, scale2, L, KV * D, True, BLOCK_N,
                                WIDEN)
        tl.store(dq_ptr + q_off + at, (dq * scale).to(dq_ptr.dtype.element_ty), mask=live[:, None])
