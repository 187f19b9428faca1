"""One decode step's cache write for a layer, keys and values, as one Triton kernel (GPU decode steps).

`SlotDecoder.write` through `index_put_` costs two indexing kernels a layer and, inside each, three elementwise
kernels that build the linear index from the broadcast (row, head, position) tensors: 48 + 144 small kernels,
0.4 ms of a 2.8 ms decode step at batch 256 on the H200 (24 layers). Here one program per (row, kv head) copies
that token's key and value (head_dim values each) to its slot's position: 24 kernels. Same values, same places.

With the rotary tables (`cos`/`sin` [max_len, head_dim]) the kernel also rotates the key at its position on the
way (float32 arithmetic, one rounding to the cache dtype, as a compiled rotary kernel does), so a decode step
needs no rotary kernel of its own: the query is rotated where attention loads it (attention_kernel.py).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _write(k, v, k_row, k_head, v_row, v_head, keys, values, c_slot, c_head, c_pos, rows, pos, cos, sin, D,
               BLOCK_D: tl.constexpr, ROPE: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        mask = d < D
        slot = tl.load(rows + b)
        at = tl.load(pos + b)
        target = slot * c_slot + h * c_head + at * c_pos + d
        key = tl.load(k + b * k_row + h * k_head + d, mask=mask)
        if ROPE:    # x * cos + rotate_half(x) * sin in float32, one rounding
            first = d < D // 2
            other = tl.load(k + b * k_row + h * k_head + tl.where(first, d + D // 2, d - D // 2), mask=mask,
                            other=0.0).to(tl.float32)
            cosine = tl.load(cos + at * D + d, mask=mask, other=0.0).to(tl.float32)
            sine = tl.load(sin + at * D + d, mask=mask, other=0.0).to(tl.float32)
            key = (key.to(tl.float32) * cosine + tl.where(first, -other, other) * sine).to(key.dtype)
        tl.store(keys + target, key, mask=mask)
        tl.store(values + target, tl.load(v + b * v_row + h * v_head + d, mask=mask), mask=mask)

    return _write


def write_kv(k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
             pos: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> None:
    """keys/values [slots, kv, max_len, D] (contiguous, the same strides) [rows[b], :, pos[b]] = k/v [B, kv, D]
    (any strides with the last dimension contiguous); with cos/sin [max_len, D] (contiguous) the key is stored
    rotated by the rotary embedding of its position."""
    batch, heads, dim = k.shape
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    rope = cos is not None
    if rope and (sin is None or not cos.is_contiguous() or not sin.is_contiguous() or cos.shape[-1] != dim):
        raise ValueError("write_kv: cos and sin must both be given, contiguous [max_len, head_dim]")
    block = 1 << max(0, (dim - 1).bit_length())
    _kernel()[(batch, heads)](k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), keys, values,
                              keys.stride(0), keys.stride(1), keys.stride(2), rows, pos,
                              cos if rope else keys, sin if rope else keys, dim, BLOCK_D=block, ROPE=rope)
