"""The decode step's cache-write kernel against index_put_ (on the CPU through Triton's interpreter)."""

import importlib.util

import pytest
import torch

from turnrl.engines.fast import cache_kernel


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter runs on the CPU)")
@pytest.mark.parametrize("dim", [64, 80])            # 80: a head size that is no power of two
def test_the_kernel_writes_what_index_put_writes(interpreted, dim):
    slots, kv, length = 6, 2, 16
    keys = torch.randn(slots, kv, length, dim).to(torch.bfloat16)
    values = torch.randn_like(keys)
    expected_keys, expected_values = keys.clone(), values.clone()
    qkv = torch.randn(4, kv, 3 * dim).to(torch.bfloat16)          # k and v as strided views of one tensor
    k, v = qkv[..., dim:2 * dim], qkv[..., 2 * dim:]
    rows, pos = torch.tensor([4, 0, 5, 2]), torch.tensor([3, 0, 15, 7])
    cache_kernel.write_kv(k, v, keys, values, rows, pos)
    index = (rows[:, None], torch.arange(kv)[None], pos[:, None])
    expected_keys.index_put_(index, k)
    expected_values.index_put_(index, v)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter runs on the CPU)")
@pytest.mark.parametrize("dim", [64, 80])
def test_the_kernel_rotates_the_key_at_its_position(interpreted, dim):
    """With the rotary tables, the stored key is decoder.rope of it at its position (float32, rounded once);
    the value is stored as it is."""
    from turnrl.engines.fast.decoder import rope

    slots, kv, length = 6, 2, 16
    keys = torch.zeros(slots, kv, length, dim, dtype=torch.bfloat16)
    values = torch.zeros_like(keys)
    angles = torch.arange(length)[:, None] * (1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))[None]
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    qkv = torch.randn(4, kv, 3 * dim).to(torch.bfloat16)
    k, v = qkv[..., dim:2 * dim], qkv[..., 2 * dim:]
    rows, pos = torch.tensor([4, 0, 5, 2]), torch.tensor([3, 0, 15, 7])
    cache_kernel.write_kv(k, v, keys, values, rows, pos, cos, sin)
    rotated = rope(k.float(), cos[pos][:, None].float(), sin[pos][:, None].float())
    got = keys[rows[:, None], torch.arange(kv)[None], pos[:, None]]
    assert torch.allclose(got.float(), rotated.to(torch.bfloat16).float(), rtol=2 ** -7, atol=1e-6)
    assert not torch.equal(got[1:], k[1:])                       # positions past 0 do rotate
    assert torch.equal(values[rows[:, None], torch.arange(kv)[None], pos[:, None]], v)
    with pytest.raises(ValueError, match="cos and sin"):
        cache_kernel.write_kv(k, v, keys, values, rows, pos, cos, None)
