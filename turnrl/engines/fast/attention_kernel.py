"""One decode step's attention over the slot cache as Triton kernels (split-key "flash decoding", GPU steps).

The torch path (`decoder.decode_attention`) reads every row's first n_kv cached positions, n_kv the step's
bucket (a multiple of 128 covering the longest row), through two batched GEMMs and a softmax over the
[B, heads, n_kv] scores: three kernels and a score tensor in memory per layer, and the keys past a row's own
position read for nothing. Here a program takes one (row, key/value head, split of the row's live keys
[0, pos]): its queries (the group of heads sharing that key/value head) against its keys in blocks, with an
online softmax, writing a partial maximum, sum and output; a second kernel combines a row's splits (with one
split a row, for buckets under 2 x SPLIT_KEYS positions, the program writes the output and no combine runs). A row
reads only its own live keys; long caches are split (one split per SPLIT_KEYS positions of the bucket, so a
few long rows still spread over the machine). On the H200 at batch 256 x 512 positions it takes 17 us a
layer against the torch path's 63 (benchmarks/results/h200_decode_attention_probe_2026-12-04.json). Not
batch-invariant (the split count follows n_kv); exact mode has its own kernel (`turnrl.exact.triton_ops`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from turnrl.exact.triton_build import pow2, usable_on

BLOCK_N = 64        # keys per inner step
SPLIT_KEYS = 512    # about this many of a bucket's positions per split ...
MAX_SPLITS = 16     # ... and at most this many splits
WARPS, STAGES = 4, 3   # the fastest of 99 blockings on the H200 (benchmarks/decode_attention_probe.py)


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def split_attention(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, KV, G, D,
                        per_split, scale, sq_b, sk_s, sk_h, sk_l, sv_s, sv_h, sv_l, so_b, SPLITS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WIDEN: tl.constexpr,
                        ROPE: tl.constexpr):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b, h = bh // KV, bh % KV
        g = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        qmask = (g[:, None] < G) & (d[None, :] < D)
        q_rows = q_ptr + b.to(tl.int64) * sq_b + (h * G + g[:, None]) * D
        q = tl.load(q_rows + d[None, :], mask=qmask, other=0.0)
        at = tl.load(pos_ptr + b)
        if ROPE:    # the query's rotary embedding at its position: float32, one rounding, as a rotary kernel
            first = d[None, :] < D // 2
            other = tl.load(q_rows + tl.where(first, d[None, :] + D // 2, d[None, :] - D // 2), mask=qmask,
                            other=0.0).to(tl.float32)
            cosine = tl.load(cos_ptr + at * D + d, mask=d < D, other=0.0).to(tl.float32)
            sine = tl.load(sin_ptr + at * D + d, mask=d < D, other=0.0).to(tl.float32)
            q = (q.to(tl.float32) * cosine[None, :] + tl.where(first, -other, other) * sine[None, :]).to(q.dtype)
        if WIDEN:   # the interpreter's (tests) bf16/fp16 dots are wrong: widen there
            q = q.to(tl.float32)
        live = at + 1                                       # keys [0, pos] are visible
        start = split * per_split
        end = tl.minimum(start + per_split, live)
        top = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        cols = tl.arange(0, BLOCK_N)
        k_base = k_ptr + b.to(tl.int64) * sk_s + h * sk_h
        v_base = v_ptr + b.to(tl.int64) * sv_s + h * sv_h
        for j in range(start, end, BLOCK_N):
            kpos = j + cols
            kmask = (kpos[:, None] < end) & (d[None, :] < D)
            k = tl.load(k_base + kpos[:, None] * sk_l + d[None, :], mask=kmask, other=0.0)
            v = tl.load(v_base + kpos[:, None] * sv_l + d[None, :], mask=kmask, other=0.0)
            if WIDEN:
                k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(kpos[None, :] < end, s, float("-inf"))
            new_top = tl.maximum(top, tl.max(s, axis=1))
            alpha = tl.exp(top - new_top)
            p = tl.exp(s - new_top[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            top = new_top
        if SPLITS == 1:     # the row's only split holds key 0 (total > 0): its output, with no combine kernel
            tl.store(out_ptr + b.to(tl.int64) * so_b + (h * G + g[:, None]) * D + d[None, :],
                     (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)
        else:
            at = (bh * SPLITS + split) * BLOCK_M + g
            tl.store(m_ptr + at, top)
            tl.store(l_ptr + at, total)
            tl.store(acc_ptr + at[:, None] * BLOCK_D + d[None, :], acc)

    @triton.jit
    def combine(m_ptr, l_ptr, acc_ptr, out_ptr, KV, G, D, so_b, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr):
        bh = tl.program_id(0)
        b, h = bh // KV, bh % KV
        s = tl.arange(0, SPLITS)
        g = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        at = (bh * SPLITS + s[:, None]) * BLOCK_M + g[None, :]         # [SPLITS, BLOCK_M]
        m = tl.load(m_ptr + at)
        top = tl.max(m, axis=0)                                       # split 0 always holds key 0: finite
        weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - top[None, :]))
        total = tl.sum(tl.load(l_ptr + at) * weight, axis=0)
        acc = tl.load(acc_ptr + at[:, :, None] * BLOCK_D + d[None, None, :])   # [SPLITS, BLOCK_M, BLOCK_D]
        out = tl.sum(acc * weight[:, :, None], axis=0) / total[:, None]
        tl.store(out_ptr + b.to(tl.int64) * so_b + (h * G + g[:, None]) * D + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(g[:, None] < G) & (d[None, :] < D))

    return split_attention, combine


def splits_for(n_kv: int, split_keys: int = SPLIT_KEYS) -> int:
    """Splits per (row, key/value head) for a step over n_kv positions: a power of two (a constexpr)."""
    want = max(1, min(MAX_SPLITS, n_kv // split_keys))
    return 1 << (want.bit_length() - 1)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, n_kv: int,
                     scaling: float, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                     block_n: int | None = None, split_keys: int | None = None, warps: int | None = None,
                     stages: int | None = None) -> torch.Tensor:
    """`decoder.decode_attention` in two kernels: q [B, heads, D] (last two axes contiguous) of slots [0, B),
    keys/values [slots, kv, max_len, D], each row seeing its positions [0, pos] -> [B, heads * D]. With the
    rotary tables cos/sin [max_len, D] (contiguous), q is given unrotated and rotated at its position pos as it
    is loaded. The blocking arguments are for benchmarks/decode_attention_probe.py."""
    batch, heads, dim = q.shape
    kv = keys.shape[1]
    group = heads // kv
    rope = cos is not None
    if rope and (sin is None or not cos.is_contiguous() or not sin.is_contiguous() or cos.shape[-1] != dim):
        raise ValueError("decode_attention: cos and sin must both be given, contiguous [max_len, head_dim]")
    q = q if q.stride(-1) == 1 and q.stride(-2) == dim else q.contiguous()
    # the blocking: the arguments, else the module's values at call time (benchmarks set them)
    block_n, warps, stages = block_n or BLOCK_N, warps or WARPS, stages or STAGES
    splits = splits_for(n_kv, split_keys or SPLIT_KEYS)
    per_split = -(-n_kv // splits)
    per_split = -(-per_split // block_n) * block_n
    block_m = pow2(group, 16)
    block_d = pow2(dim, 16)
    parts = batch * kv * splits * block_m if splits > 1 else 0     # one split writes `out` itself
    m = torch.empty(parts, dtype=torch.float32, device=q.device)
    total = torch.empty(parts, dtype=torch.float32, device=q.device)
    acc = torch.empty((parts, block_d), dtype=torch.float32, device=q.device)
    out = torch.empty((batch, heads * dim), dtype=q.dtype, device=q.device)
    if batch:
        split_attention, combine = _kernels()
        split_attention[(batch * kv, splits)](
            q, keys, values, pos, cos if rope else q, sin if rope else q, m, total, acc, out, kv, group, dim,
            per_split, float(scaling),
            q.stride(0), keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2), out.stride(0),
            SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, WIDEN=not q.is_cuda, ROPE=rope,
            num_warps=warps, num_stages=stages)
    if batch and splits > 1:
        combine[(batch * kv,)](m, total, acc, out, kv, group, dim, out.stride(0), SPLITS=splits, BLOCK_M=block_m,
                               BLOCK_D=block_d, num_warps=4)
    return out


def available(device: torch.device) -> bool:
    return usable_on(device, _kernels)
