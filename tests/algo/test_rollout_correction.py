"""Rollout correction against hand-computed weights, masks and metrics."""

import math

import pytest
import torch
from torch.testing import assert_close

from turnrl.algo.losses import truncated_is_weights
from turnrl.algo.rollout_correction import CorrectionSpec, correct, importance_weights, rejection_mask, veto_mask

# rho = pi_trainer / pi_engine per token. Row 0: 3, 0.4 (then padding); row 1: 1.2, 1e-5, 1.0;
# row 2: 1.0, 0.9; row 3: no policy token.
RHO = [[3.0, 0.4, 1.0], [1.2, 1e-5, 1.0], [1.0, 0.9, 1.0], [1.0, 1.0, 1.0]]
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.float32)
ENGINE = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -3.0, -0.1], [-0.2, -1.0, 0.0], [-1.0, -1.0, -1.0]])
TRAINER = ENGINE + torch.log(torch.tensor(RHO))
TRAINER[0, 2] = float("nan")  # padding garbage must not leak


def test_token_and_sequence_weights():
    w = importance_weights(TRAINER, ENGINE, MASK, "token", cap=2.0)
    assert_close(w, torch.tensor([[2.0, 0.4, 1], [1.2, 1e-5, 1.0], [1.0, 0.9, 1], [1, 1, 1]]), rtol=1e-4, atol=1e-7)
    # the existing token TIS is the token level of the same thing
    assert_close(truncated_is_weights(TRAINER, ENGINE, MASK, 2.0), w, rtol=1e-4, atol=1e-7)
    w = importance_weights(TRAINER, ENGINE, MASK, "sequence", cap=2.0)
    # products: 1.2, 1.2e-5, 0.9 on every token of the row
    assert_close(w, torch.tensor([[1.2, 1.2, 1], [1.2e-5] * 3, [0.9, 0.9, 1], [1, 1, 1]]), rtol=1e-4, atol=1e-8)
    assert importance_weights(TRAINER, ENGINE, MASK, "sequence", cap=1.1)[0, 0].item() == pytest.approx(1.1)


def test_rejection_levels_two_sided():
    keep = rejection_mask(TRAINER, ENGINE, MASK, "token", high=2.0)  # [0.5, 2]: rho 3 and 0.4 and 1e-5 leave
    assert keep.tolist() == [[False, False, False], [True, False, True], [True, True, False], [False] * 3]
    # [1/1.1, 1.1]: row 0's product 1.2 is rejected, its geometric mean sqrt(1.2) = 1.095 is not;
    # row 1: product 1.2e-5, geometric mean 0.0229: rejected both ways; row 2: 0.9 vs 0.949
    seq = rejection_mask(TRAINER, ENGINE, MASK, "sequence", high=1.1)
    geo = rejection_mask(TRAINER, ENGINE, MASK, "geometric", high=1.1)
    assert seq.tolist() == [[False] * 3, [False] * 3, [False] * 3, [False] * 3]
    assert geo.tolist() == [[True, True, False], [False] * 3, [True, True, False], [False] * 3]
    # an explicit lower bound: [0.85, 1.1] keeps row 2's product 0.9
    assert rejection_mask(TRAINER, ENGINE, MASK, "sequence", high=1.1, low=0.85)[2].tolist() == [True, True, False]


def test_veto_rejects_the_whole_sequence_of_a_catastrophic_token():
    keep = veto_mask(TRAINER, ENGINE, MASK, 1e-4)
    assert keep.tolist() == [[True, True, False], [False] * 3, [True, True, False], [False] * 3]


def test_correct_combines_and_measures():
    spec = CorrectionSpec(is_level="token", is_cap=2.0, rs_level="token", rs_high=2.0, veto=1e-4)
    c = correct(TRAINER, ENGINE, MASK, spec)
    assert c.keep.tolist() == [[False, False, False], [False] * 3, [True, True, False], [False] * 3]
    m = c.metrics
    assert m.weight_mean.item() == pytest.approx((2 + 0.4 + 1.2 + 1e-5 + 1 + 1 + 0.9) / 7, rel=1e-5)
    assert m.truncated_fraction.item() == pytest.approx(1 / 7)
    assert m.rejected_token_fraction.item() == pytest.approx(5 / 7)
    assert m.rejected_seq_fraction.item() == pytest.approx(2 / 3)  # row 3 has no policy token: not counted
    assert m.veto_seq_fraction.item() == pytest.approx(1 / 3)
    off = correct(TRAINER, ENGINE, MASK, CorrectionSpec())
    assert off.weights is None and off.keep.tolist() == MASK.bool().tolist()
    assert off.metrics.weight_mean.item() == 1.0 and off.metrics.rejected_token_fraction.item() == 0.0


def test_spec_errors_say_what_to_set():
    with pytest.raises(ValueError, match="rs_high"):
        CorrectionSpec(rs_level="geometric")
    with pytest.raises(ValueError, match="token, sequence, geometric"):
        CorrectionSpec(rs_level="seq_max_k2", rs_high=2.0)
    with pytest.raises(ValueError, match="rs_low <= rs_high"):
        CorrectionSpec(rs_level="token", rs_high=1.5, rs_low=2.0)
    assert CorrectionSpec(rs_level="token", rs_high=4.0).low == 0.25
    assert not CorrectionSpec().active and CorrectionSpec(veto=1e-4).active
