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
