import math

import pytest
import torch
from torch.testing import assert_close

from turnrl.algo.losses import (
    AGG_MODES,
    aggregate,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    ppo_policy_loss,
    truncated_is_weights,
    value_loss,
)

NAN, INF = float("nan"), float("inf")


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


# --------------------------------------------------------------------------------------------- aggregate

# Row 0: policy tokens 1, 2, 3 around a tool token; row 1: one token; row 2: no policy token at all.
LOSS = t([[1, 2, NAN, 3], [4, 9, 9, 9], [5, 5, 5, 5]])
AGG_MASK = t([[1, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]])


def test_aggregate_hand_values():
    assert aggregate(LOSS, AGG_MASK, "token-mean").item() == 10 / 4
    assert aggregate(LOSS, AGG_MASK, "seq-mean-token-sum").item() == (6 + 4) / 2  # empty row 2 left out
    assert aggregate(LOSS, AGG_MASK, "seq-mean-token-mean").item() == (2 + 4) / 2
    assert aggregate(LOSS, AGG_MASK, "token-mean", normalizer=8).item() == 10 / 8
    assert aggregate(LOSS, AGG_MASK, "seq-mean-token-sum", normalizer=5).item() == 10 / 5
    assert aggregate(LOSS, torch.zeros(3, 4), "token-mean").item() == 0.0


def test_aggregate_validation():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum, seq-mean-token-mean"):
        aggregate(LOSS, AGG_MASK, "seq-mean")
    with pytest.raises(ValueError, match="normalizer"):
        aggregate(LOSS, AGG_MASK, "token-mean", normalizer=0)
    with pytest.raises(ValueError, match="mask has shape"):
        aggregate(LOSS, AGG_MASK[:2], "token-mean")


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("seed", range(3))
def test_aggregate_micro_batches_with_normalizer_sum_to_full_batch(mode, seed):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.4).float()
    mask[4] = 0.0  # an empty trajectory inside a micro-batch
    full = aggregate(loss, mask, mode)
    count = mask.sum() if mode == "token-mean" else mask.any(dim=1).sum()
    parts = [aggregate(loss[s], mask[s], mode, normalizer=count) for s in (slice(0, 2), slice(2, 6))]
    assert_close(parts[0] + parts[1], full)


# ------------------------------------------------------------------------------------------ policy loss

# Ratios and advantages per token (row 1's last token and row 0's t1 are masked with garbage under them):
#   a: A=+1, r=1.5 -> max(-1.5, -1.28) = -1.28 (clip-higher active)    b: A=+1, r=0.5 -> -0.5
#   c: A=-1, r=1.5 -> 1.5                                              d: A=-1, r=0.5 -> max(0.5, 0.8) = 0.8
#   e: A=-2, r=4.0 -> 8.0, or 3 * 2 = 6.0 with dual clip 3             f: A=+2, r=1.1 -> -2.2
RATIOS = [[1.5, 1.0, 0.5, 1.5], [0.5, 4.0, 1.1, 1.0]]
OLD = t([[-1.0, -2.0, -0.5, -3.0], [-1.5, -4.0, -0.25, -1.0]])
ADV = t([[1, 1e6, 1, -1], [-1, -2, 2, NAN]])
PG_MASK = t([[1, 0, 1, 1], [1, 1, 1, 0]])


def _logprobs(garbage=0.0):
    lp = OLD + torch.log(t(RATIOS))
    lp = torch.where(PG_MASK.bool(), lp, torch.full_like(lp, garbage))
    return lp.requires_grad_(True)


def test_ppo_policy_loss_hand_values():
    lp = _logprobs()
    out = ppo_policy_loss(lp, OLD, ADV, PG_MASK, clip_low=0.2, clip_high=0.28)
    assert_close(out.loss, torch.tensor((-1.28 - 0.5 + 1.5 + 0.8 + 8.0 - 2.2) / 6))
    assert_close(out.clip_fraction, torch.tensor(2 / 6))  # tokens a and d
    assert_close(out.dual_clip_fraction, torch.tensor(0.0))
    assert_close(out.ratio_mean, torch.tensor((1.5 + 0.5 + 1.5 + 0.5 + 4.0 + 1.1) / 6))
    ratios = [1.5, 0.5, 1.5, 0.5, 4.0, 1.1]
    assert_close(out.approx_kl, torch.tensor(sum(r - 1 - math.log(r) for r in ratios) / 6))
    assert not out.approx_kl.requires_grad and out.loss.requires_grad
    out.loss.backward()
    # d/dlogp of -A * r is -A * r where the unclipped branch wins, 0 where the clip wins; / 6 tokens.
    assert_close(lp.grad, t([[0, 0, -0.5 / 6, 1.5 / 6], [0, 8.0 / 6, -2.2 / 6, 0]]))


def test_dual_clip_caps_the_loss_of_negative_advantages():
    lp = _logprobs()
    out = ppo_policy_loss(lp, OLD, ADV, PG_MASK, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert_close(out.loss, torch.tensor((-1.28 - 0.5 + 1.5 + 0.8 + 6.0 - 2.2) / 6))
    assert_close(out.dual_clip_fraction, torch.tensor(1 / 6))
    out.loss.backward()
    assert lp.grad[1, 1].item() == 0.0  # the capped token no longer pushes
    # A huge ratio on a positive advantage is untouched by dual clip (only the ordinary clip applies).
    pos = ppo_policy_loss(t([[math.log(50.0)]]), torch.zeros(1, 1), t([[1.0]]), t([[1]]), clip_high=0.2,
                          dual_clip=3.0)
    assert_close(pos.loss, torch.tensor(-1.2))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(_logprobs(), OLD, ADV, PG_MASK, dual_clip=1.0)


def test_asymmetric_clip_uses_clip_high_for_positive_and_clip_low_for_negative_advantages():
    mask = t([[1, 1]])
    lp = torch.log(t([[1.5, 0.75]]))
    old = torch.zeros(1, 2)
    adv = t([[1.0, -1.0]])
    out = ppo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg="seq-mean-token-sum")
    # A>0: r clipped at 1 + 0.28 -> -1.28; A<0: r=0.75 clipped up to 1 - 0.2 = 0.8 -> 0.8
    assert_close(out.loss, torch.tensor(-1.28 + 0.8))
    swapped = ppo_policy_loss(lp, old, adv, mask, clip_low=0.28, clip_high=0.2, agg="seq-mean-token-sum")
    # now A>0 is clipped at 1.2 and A<0 at 0.72 (which 0.75 does not reach)
    assert_close(swapped.loss, torch.tensor(-1.2 + 0.75))


def test_ppo_policy_loss_is_weights_and_seq_agg():
    w = t([[0.5, 99, 1, 2], [1, 1, 1, 99]]).requires_grad_(True)
    out = ppo_policy_loss(_logprobs(), OLD, ADV, PG_MASK, clip_low=0.2, clip_high=0.28, is_weights=w)
    assert_close(out.loss, torch.tensor((-1.28 * 0.5 - 0.5 + 1.5 * 2 + 0.8 + 8.0 - 2.2) / 6))
    out.loss.backward()
    assert w.grad is None  # weights are detached
    seq = ppo_policy_loss(
        _logprobs(), OLD, ADV, PG_MASK, clip_low=0.2, clip_high=0.28, agg="seq-mean-token-sum"
    )
    assert_close(seq.loss, torch.tensor(((-1.28 - 0.5 + 1.5) + (0.8 + 8.0 - 2.2)) / 2))


def test_policy_gradient_is_exactly_zero_on_masked_positions_even_with_garbage():
    clean = ppo_policy_loss(_logprobs(), OLD, ADV, PG_MASK, dual_clip=3.0)
    for garbage in (NAN, INF, -INF, 1e9):
        lp = _logprobs(garbage)
        out = ppo_policy_loss(lp, OLD, ADV, PG_MASK, dual_clip=3.0)
        for a, b in zip(out, clean):
            assert torch.equal(a.detach(), b.detach())
        out.loss.backward()
        assert torch.isfinite(lp.grad).all()
        assert torch.equal(lp.grad[~PG_MASK.bool()], torch.zeros(2))


def test_policy_loss_micro_batches_match_full_batch():
    full = ppo_policy_loss(_logprobs(), OLD, ADV, PG_MASK)
    n = PG_MASK.sum()
    rows = [slice(0, 1), slice(1, 2)]
    parts = [ppo_policy_loss(_logprobs()[r], OLD[r], ADV[r], PG_MASK[r], normalizer=n) for r in rows]
    assert_close(parts[0].loss + parts[1].loss, full.loss)


# ------------------------------------------------------------------------------------------------ KL etc.


def test_kl_penalty_hand_values_and_aliases():
    lp = t([[-1.0, -2.0, -0.5]])
    ref = t([[-1.5, -1.0, -0.5]])  # log ratio 0.5, -1, 0
    assert_close(kl_penalty(lp, ref, "k1"), t([[0.5, -1.0, 0.0]]))
    assert_close(kl_penalty(lp, ref, "k2"), t([[0.125, 0.5, 0.0]]))
    assert_close(kl_penalty(lp, ref, "k3"), t([[math.exp(-0.5) + 0.5 - 1, math.e - 2, 0.0]]))
    assert torch.equal(kl_penalty(lp, ref, "mse"), kl_penalty(lp, ref, "k2"))
    assert torch.equal(kl_penalty(lp, ref, "low_var_kl"), kl_penalty(lp, ref, "k3"))


def test_k3_is_clamped():
    lp = torch.zeros(1, 3)
    ref = t([[30.0, 12.0, -30.0]])
    # exp(20) - 21 and exp(12) - 13 exceed 10; exp(-20) + 19 too: all clamp to 10, no inf
    assert torch.equal(kl_penalty(lp, ref, "k3"), t([[10.0, 10.0, 10.0]]))
    assert_close(kl_penalty(t([[0.0]]), t([[2.0]]), "k3"), t([[math.exp(2) - 3]]))


def test_kl_unknown_kind_lists_valid_kinds():
    with pytest.raises(ValueError, match="k1, k2, mse, k3, low_var_kl"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "kl")


def test_truncated_is_weights():
    trainer = t([[-1.0, -1.0, -2.0, -0.5]]).requires_grad_(True)
    engine = t([[-1.5, -0.5, NAN, -10.0]])
    w = truncated_is_weights(trainer, engine, t([[1, 1, 0, 1]]), cap=2.0)
    assert_close(w, t([[math.exp(0.5), math.exp(-0.5), 1.0, 2.0]]))
    assert not w.requires_grad
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(trainer, engine, t([[1, 1, 0, 1]]), cap=0)


def test_value_loss_hand_values_and_gradient():
    # clip 0.2; the middle token is a masked tool token.
    #  v=1.0 old=0.5 R=1.2: clipped v 0.7, errs 0.04 vs 0.25 -> 0.125 (clip wins)
    #  v=0.6 old=0.5 R=1.0: inside the clip -> 0.5 * 0.16 = 0.08
    #  v=0.0 old=0.5 R=-1.0: clipped v 0.3, errs 1.0 vs 1.69 -> 0.845 (clip wins)
    #  v=2.0 old=1.0 R=0.0: clipped v 1.2, errs 4.0 vs 1.44 -> 2.0
    v = t([[1.0, NAN, 0.6, 0.0, 2.0]]).requires_grad_(True)
    old = t([[0.5, 3.0, 0.5, 0.5, 1.0]])
    ret = t([[1.2, INF, 1.0, -1.0, 0.0]])
    mask = t([[1, 0, 1, 1, 1]])
    loss, clip_fraction = value_loss(v, old, ret, mask, clip=0.2)
    assert_close(loss, torch.tensor((0.125 + 0.08 + 0.845 + 2.0) / 4))
    assert_close(clip_fraction, torch.tensor(0.5))
    loss.backward()
    assert_close(v.grad, t([[0.0, 0.0, (0.6 - 1.0) / 4, 0.0, (2.0 - 0.0) / 4]]))


# -------------------------------------------------------------------------------------- logits maths


def test_entropy_hand_values():
    ln2 = math.log(2)
    logits = t([[[0, 0, 0], [0, 0, ln2], [1000, 1000, 1000]]])
    # uniform over 3; probs (1/4, 1/4, 1/2); huge but equal logits stay uniform
    expected = t([[math.log(3), 0.5 * math.log(4) + 0.5 * ln2, math.log(3)]])
    assert_close(entropy_from_logits(logits), expected)
    assert_close(entropy_from_logits(logits, chunk_size=1), expected)


def test_logprobs_hand_values_and_temperature():
    ln2 = math.log(2)
    logits = t([[[0, 0, ln2], [0, 0, ln2]]])
    labels = torch.tensor([[2, 0]])
    assert_close(logprobs_from_logits(logits, labels), t([[-ln2, -2 * ln2]]))
    # logits [0, 0, 2 ln 2] at temperature 2 are the same distribution as [0, 0, ln 2]
    hot = t([[[0, 0, 2 * ln2], [0, 0, 2 * ln2]]])
    assert_close(logprobs_from_logits(hot, labels, temperature=2.0), t([[-ln2, -2 * ln2]]))
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(hot, labels, temperature=0.0)


@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
def test_chunked_logits_maths_match_torch(chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 7, 11, generator=g) * 3).requires_grad_(True)
    labels = torch.randint(0, 11, (2, 7), generator=g)
    ref_logp = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    assert_close(logprobs_from_logits(logits, labels, temperature=0.7, chunk_size=chunk_size), ref_logp)
    p = torch.softmax(logits, dim=-1)
    ref_h = -(p * torch.log_softmax(logits, dim=-1)).sum(-1)
    h = entropy_from_logits(logits, chunk_size=chunk_size)
    assert_close(h, ref_h)
    # Gradients flow through the chunks (entropy bonuses need them).
    (g1,) = torch.autograd.grad(h.sum(), logits)
    (g2,) = torch.autograd.grad(ref_h.sum(), logits)
    assert_close(g1, g2)
    # bf16 logits come back as float32 computed in float32.
    low = logprobs_from_logits(logits.detach().bfloat16(), labels, 0.7, chunk_size)
    assert low.dtype == torch.float32
    assert_close(low, ref_logp.detach(), atol=0.1, rtol=0)
