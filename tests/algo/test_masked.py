import math

import pytest
import torch
from torch.testing import assert_close

from turnrl.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten

NAN = float("nan")
# Row 0 has a hole in the middle (a tool token); row 1 holds NaN under its mask to prove it cannot leak.
X = torch.tensor([[1.0, 2.0, 100.0, 3.0], [4.0, NAN, 5.0, 6.0]])
M = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0]])


def test_sum_and_mean_hand_values():
    assert masked_sum(X, M).item() == 15.0  # 1 + 2 + 3 + 4 + 5
    assert_close(masked_sum(X, M, dim=1), torch.tensor([6.0, 9.0]))
    assert masked_mean(X, M).item() == 3.0
    assert_close(masked_mean(X, M, dim=1), torch.tensor([2.0, 4.5]))
    assert_close(masked_mean(X, M, dim=0), torch.tensor([2.5, 2.0, 5.0, 3.0]))


def test_var_hand_values():
    # values 1..5, mean 3, squared deviations sum to 10
    assert_close(masked_var(X, M), torch.tensor(10.0 / 4))
    assert_close(masked_var(X, M, unbiased=False), torch.tensor(10.0 / 5))
    # row 0: {1, 2, 3} -> sq dev 2; row 1: {4, 5} -> sq dev 0.5
    assert_close(masked_var(X, M, dim=1), torch.tensor([1.0, 0.5]))
    assert_close(masked_var(X, M, dim=1, unbiased=False), torch.tensor([2.0 / 3, 0.25]))


def test_whiten_hand_values():
    std = math.sqrt(2.5 + 1e-8)
    expected = torch.tensor([[-2 / std, -1 / std, 0.0, 0.0], [1 / std, 0.0, 2 / std, 0.0]])
    assert_close(masked_whiten(X, M), expected)
    shifted_back = torch.tensor([[3 - 2 / std, 3 - 1 / std, 0.0, 3.0], [3 + 1 / std, 0.0, 3 + 2 / std, 0.0]])
    assert_close(masked_whiten(X, M, shift_mean=False), shifted_back)


def test_empty_mask_gives_zero_not_nan():
    x = torch.tensor([[1.0, NAN], [float("inf"), 2.0]])
    zero = torch.zeros(2, 2)
    assert masked_sum(x, zero).item() == 0.0
    assert masked_mean(x, zero).item() == 0.0
    assert masked_var(x, zero).item() == 0.0
    assert torch.equal(masked_whiten(x, zero), zero)
    row_mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    assert_close(masked_mean(x, row_mask, dim=1), torch.tensor([1.0, 0.0]))


def test_single_position_has_zero_unbiased_variance():
    x = torch.tensor([5.0, 7.0])
    m = torch.tensor([0.0, 1.0])
    assert masked_var(x, m).item() == 0.0
    assert masked_var(x, m, unbiased=False).item() == 0.0
    assert torch.equal(masked_whiten(x, m), torch.zeros(2))


def test_bool_and_float_masks_agree():
    assert_close(masked_mean(X, M.bool(), dim=1), masked_mean(X, M, dim=1))
    assert_close(masked_whiten(X, M.bool()), masked_whiten(X, M))


def test_shape_mismatch_is_a_value_error():
    with pytest.raises(ValueError, match="mask has shape"):
        masked_mean(X, M[:, :3])


@pytest.mark.parametrize("seed", range(5))
def test_values_under_mask_zero_never_matter(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 7, generator=g)
    m = (torch.rand(4, 7, generator=g) > 0.4).float()
    garbage = torch.where(m.bool(), x, torch.randn(4, 7, generator=g) * 1e6)
    for fn in (masked_sum, masked_mean, masked_var):
        assert torch.equal(fn(x, m), fn(garbage, m))
        assert torch.equal(fn(x, m, dim=1), fn(garbage, m, dim=1))
    assert torch.equal(masked_whiten(x, m), masked_whiten(garbage, m))
    # And the reductions match torch's own on the selected values.
    sel = x[m.bool()]
    assert_close(masked_mean(x, m), sel.mean())
    assert_close(masked_var(x, m), sel.var())
