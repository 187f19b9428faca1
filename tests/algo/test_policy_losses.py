"""GSPO, CISPO and GMPO against values worked out by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch
from torch.testing import assert_close

from turnrl.algo.losses import ppo_policy_loss
from turnrl.algo.policy_losses import (LOSS_MODES, cispo_policy_loss, gmpo_policy_loss, gspo_policy_loss,
                                       policy_loss)

NAN = float("nan")


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def leaf(rows):
    return t(rows).requires_grad_(True)


# ------------------------------------------------------------------------------------------------- GSPO

def test_gspo_sequence_ratio_and_gradient_by_hand():
    # row 0: log-ratios 0.2, -0.1 (a tool token between them, NaN under mask 0): s0 = exp(0.05) = 1.051271, A = 1
    # row 1: log-ratios 0, 0, -0.03: s1 = exp(-0.01) = 0.990050, A = -2
    lp = leaf([[-1.0, NAN, -2.0, 0.0], [-0.5, -0.5, -0.5, 0.0]])
    old = t([[-1.2, 0.0, -1.9, 0.0], [-0.5, -0.5, -0.47, 0.0]])
    mask = t([[1, 0, 1, 0], [1, 1, 1, 0]])
    adv = t([[1, 1, 1, 0], [-2, -2, -2, 0]])
    out = gspo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    s0, s1 = math.exp(0.05), math.exp(-0.01)
    # seq-mean-token-mean: each row's tokens all carry -A * s, the mean over 2 rows
    assert out.loss.item() == pytest.approx((-s0 + 2 * s1) / 2, abs=1e-5)
    assert out.ratio_mean.item() == pytest.approx((2 * s0 + 3 * s1) / 5, abs=1e-5)
    assert out.clip_fraction.item() == 0.0
    out.loss.backward()
    # d/d lp_t of mean_t(-A s) = -A s / |y| (every token moves s), then / 2 rows
    want = t([[-s0 / 2 / 2, 0, -s0 / 2 / 2, 0], [2 * s1 / 3 / 2] * 3 + [0]])
    assert_close(lp.grad, want, atol=1e-6, rtol=1e-5)


def test_gspo_token_form_has_the_sequence_objective_gradient():
    torch.manual_seed(0)
    lp0 = torch.randn(3, 5) * 0.1 - 1
    old = lp0 + torch.randn(3, 5) * 0.05
    mask = t([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    adv = t([[0.5] * 5, [-1.0] * 5, [2.0] * 5])
    lp = lp0.clone().requires_grad_(True)
    gspo_policy_loss(lp, old, adv, mask, clip_low=0.9, clip_high=10.0).loss.backward()  # no clipping
    ref = lp0.clone().requires_grad_(True)
    m = mask.bool()
    s = torch.exp(torch.where(m, ref - old, 0).sum(1) / m.sum(1))  # the paper's s_i
    (-(adv[:, 0] * s)).mean().backward()
    assert_close(lp.grad, torch.where(m, ref.grad, 0))


def test_gspo_clips_whole_sequences():
    # s0 = exp(0.05) > 1 + 4e-4 with A > 0: the clipped branch is a constant: no gradient for the row
    lp = leaf([[-1.0, -2.0]])
    out = gspo_policy_loss(lp, t([[-1.2, -1.9]]), t([[1, 1]]), t([[1, 1]]))  # paper's eps 3e-4 / 4e-4
    assert out.loss.item() == pytest.approx(-(1 + 4e-4), abs=1e-6)
    assert out.clip_fraction.item() == 1.0
    out.loss.backward()
    assert lp.grad.abs().sum().item() == 0.0


# ------------------------------------------------------------------------------------------------ CISPO

def test_cispo_clipped_stop_gradient_weights_by_hand():
    # ratios 1.5, 0.5, 1.0 -> weights clip(r, 0.8, 1.28) = 1.28, 0.8, 1.0; A = 1, 1, -1; log pi = -1, -2, -0.5
    lp = leaf([[-1.0, -2.0, -0.5]])
    old = t([[-1.0 - math.log(1.5), -2.0 - math.log(0.5), -0.5]])
    adv = t([[1, 1, -1]])
    out = cispo_policy_loss(lp, old, adv, t([[1, 1, 1]]), clip_low=0.2, clip_high=0.28)
    # loss_t = -w * A * log pi = 1.28, 1.6, -0.5; token mean = 2.38 / 3
    assert out.loss.item() == pytest.approx(2.38 / 3, abs=1e-5)
    assert out.clip_fraction.item() == pytest.approx(2 / 3)
    out.loss.backward()
    # the weight is a constant: d loss / d log pi_t = -w A / 3; clipped tokens keep their gradient (unlike PPO)
    assert_close(lp.grad, t([[-1.28 / 3, -0.8 / 3, 1 / 3]]))


def test_cispo_without_a_lower_bound_and_on_policy_equals_ppo_gradient():
    lp = leaf([[-1.0, -2.0]])
    out = cispo_policy_loss(lp, t([[-0.2, -2.0]]), t([[-1, -1]]), t([[1, 1]]), clip_low=1.0, clip_high=0.28)
    assert out.clip_fraction.item() == 0.0  # ratio exp(-0.8) = 0.449 stays: no lower bound with clip_low = 1
    # on-policy (old = current): the same gradient as PPO's
    a, b = leaf([[-1.0, -2.0]]), leaf([[-1.0, -2.0]])
    adv, mask = t([[0.7, -0.3]]), t([[1, 1]])
    cispo_policy_loss(a, a.detach(), adv, mask).loss.backward()
    ppo_policy_loss(b, b.detach(), adv, mask).loss.backward()
    assert_close(a.grad, b.grad)


# ------------------------------------------------------------------------------------------------- GMPO

def test_gmpo_geometric_mean_with_sign_aware_log_clip_by_hand():
    # row 0, A = +1, log-ratios 0.5, -0.1: clip to [-0.4, 0.4] only where it lowers A * l: 0.4, -0.1
    #   mean 0.15, loss -exp(0.15) = -1.161834
    # row 1, A = -1, log-ratios -0.6, 0.2: for A < 0 the larger of l and clip(l) counts: -0.4, 0.2
    #   mean -0.1, loss +exp(-0.1) = 0.904837
    lp = leaf([[0.5, -0.1], [-0.6, 0.2]])
    old = torch.zeros(2, 2)
    adv = t([[1, 1], [-1, -1]])
    out = gmpo_policy_loss(lp, old, adv, torch.ones(2, 2), clip_low=0.4, clip_high=0.4)
    assert out.loss.item() == pytest.approx((-math.exp(0.15) + math.exp(-0.1)) / 2, abs=1e-6)
    assert out.clip_fraction.item() == 0.5
    out.loss.backward()
    # clipped tokens are constants; the others: d/dl of -A exp(mean l) = -A exp(mean l) / 2, then / 2 rows
    assert_close(lp.grad, t([[0, -math.exp(0.15) / 4], [0, math.exp(-0.1) / 4]]))


def test_gmpo_refuses_token_mean():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        gmpo_policy_loss(leaf([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1.0]]), agg="token-mean")


# ------------------------------------------------------------------------------------------ dispatching

@pytest.mark.parametrize("mode", LOSS_MODES)
def test_every_mode_keeps_masked_positions_out(mode):
    lp = leaf([[-1.0, NAN, -0.5], [-0.3, -0.2, NAN]])
    old = t([[-1.1, 5.0, -0.4], [-0.3, -0.25, NAN]])
    mask = t([[1, 0, 1], [1, 1, 0]])
    adv = t([[1.0, NAN, 1.0], [-0.5, -0.5, NAN]])
    agg = "token-mean" if mode in ("ppo", "cispo") else "seq-mean-token-mean"
    out = policy_loss(mode, lp, old, adv, mask, 0.2, 0.28, agg=agg, is_weights=t([[1.0, NAN, 0.5], [2.0, 1.0, 9]]))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[1, 2].item() == 0.0


def test_dispatch_errors_name_the_fix():
    args = (leaf([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1.0]]), 0.2, 0.2)
    with pytest.raises(ValueError, match="ppo, gspo, cispo, gmpo"):
        policy_loss("sapo", *args)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss("cispo", *args, dual_clip=3.0)
