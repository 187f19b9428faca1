"""The decode step's split-key attention kernels against the torch path (on the CPU through Triton's interpreter)."""

import importlib.util

import pytest
import torch

from turnrl.engines.fast import attention_kernel
from turnrl.engines.fast.decoder import decode_attention


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter runs on the CPU)")
@pytest.mark.parametrize(("heads", "kv", "dim", "n_kv"), [(14, 2, 64, 512), (9, 3, 64, 128), (4, 4, 80, 256)])
def test_the_kernels_attend_as_the_torch_path(interpreted, heads, kv, dim, n_kv):
    """Rows at the first position, inside a split, on a split's edge and at the last one; a group of 7 heads
    (padded to 16 queries), one of 1, a head size that is no power of two; one split up to eight."""
    g = torch.Generator().manual_seed(heads)
    slots = 6
    keys = torch.randn(slots, kv, n_kv + 64, dim, generator=g).half()   # stale positions past n_kv
    values = torch.randn(slots, kv, n_kv + 64, dim, generator=g).half()
    pos = torch.tensor([0, 63, 64, n_kv // 2 + 5, n_kv - 1])
    q = torch.randn(5, heads, dim, generator=g).half()
    want = decode_attention(q.float(), keys.float(), values.float(), pos, n_kv, 0.125)
    for split_keys in (64, attention_kernel.SPLIT_KEYS):        # several splits, and the default's
        got = attention_kernel.decode_attention(q, keys, values, pos, n_kv, 0.125, split_keys=split_keys)
        assert got.shape == (5, heads * dim) and got.dtype == torch.float16
        assert torch.allclose(got.float(), want, atol=3e-3, rtol=3e-3), split_keys
    assert attention_kernel.splits_for(n_kv, 64) == min(16, n_kv // 64)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter runs on the CPU)")
def test_the_kernels_rotate_the_query_at_its_position(interpreted):
    """Given the rotary tables, the kernels take q unrotated and attend as the torch path on rope(q) at each
    row's position."""
    from turnrl.engines.fast.decoder import rope

    g = torch.Generator().manual_seed(1)
    heads, kv, dim, n_kv = 14, 2, 64, 256
    keys = torch.randn(5, kv, n_kv, dim, generator=g).half()
    values = torch.randn(5, kv, n_kv, dim, generator=g).half()
    angles = torch.arange(n_kv)[:, None] * (1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))[None]
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().half(), angles.sin().half()
    pos = torch.tensor([0, 17, 100, 255])
    q = torch.randn(4, heads, dim, generator=g).half()
    rotated = rope(q.float(), cos[pos][:, None].float(), sin[pos][:, None].float()).half()
    want = decode_attention(rotated.float(), keys.float(), values.float(), pos, n_kv, 0.125)
    got = attention_kernel.decode_attention(q, keys, values, pos, n_kv, 0.125, cos, sin)
    assert torch.allclose(got.float(), want, atol=3e-3, rtol=3e-3)
    unrotated = attention_kernel.decode_attention(q, keys, values, pos, n_kv, 0.125)
    assert not torch.allclose(unrotated.float(), want, atol=3e-3, rtol=3e-3)
