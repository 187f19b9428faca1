import math

import pytest
import torch
from torch.testing import assert_close

from turnrl.algo.advantages import (
    broadcast,
    gae,
    grpo,
    grpo_turn_level,
    reinforce_pp,
    rloo,
    turn_returns,
)
from turnrl.algo.masked import masked_whiten

# Three groups with non-contiguous ids: {10: [1, 0, 1]}, {3: [1, 0.5]}, {42: [7]} (a singleton).
REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 7.0])
GROUPS = torch.tensor([10, 10, 10, 3, 3, 42])


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


# ------------------------------------------------------------------------------------------- grpo / rloo


def test_grpo_hand_values():
    eps = 1e-6
    std10 = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)  # unbiased std of [1, 0, 1]
    std3 = math.sqrt(0.25**2 * 2 / 1)  # unbiased std of [1, 0.5]
    expected = t([
        (1 / 3) / (std10 + eps), (-2 / 3) / (std10 + eps), (1 / 3) / (std10 + eps),
        0.25 / (std3 + eps), -0.25 / (std3 + eps),
        0.0,
    ])
    assert_close(grpo(REWARDS, GROUPS), expected)
    decimals = t([0.5773493, -1.1546986, 0.5773493, 0.7071048, -0.7071048, 0.0])
    assert_close(grpo(REWARDS, GROUPS, eps=eps), decimals)


def test_dr_grpo_is_reward_minus_group_mean():
    assert_close(grpo(REWARDS, GROUPS, normalize_std=False), t([1 / 3, -2 / 3, 1 / 3, 0.25, -0.25, 0.0]))
    g = torch.Generator().manual_seed(0)
    r = torch.randn(12, generator=g)
    ids = torch.tensor([5, 5, 5, 9, 9, 9, 9, 1, 1, 1, 1, 1])
    means = {i: r[ids == i].mean() for i in (5, 9, 1)}
    assert_close(grpo(r, ids, normalize_std=False), r - torch.stack([means[int(i)] for i in ids]))


def test_grpo_identical_rewards_and_int_rewards():
    assert torch.equal(grpo(torch.tensor([1, 1, 1]), torch.tensor([0, 0, 0])), torch.zeros(3))
    # Integer rewards are promoted to float, not truncated.
    got = grpo(torch.tensor([1, 0]), torch.tensor([4, 4]), eps=0.0)
    assert_close(got, t([1 / math.sqrt(2), -1 / math.sqrt(2)]))


def test_rloo_hand_values():
    # group 10: 1 - mean(0, 1), 0 - mean(1, 1), 1 - mean(1, 0); group 3: 1 - 0.5, 0.5 - 1; singleton: 0
    assert_close(rloo(REWARDS, GROUPS), t([0.5, -1.0, 0.5, 0.5, -0.5, 0.0]))


def test_group_ids_validation():
    with pytest.raises(ValueError, match="one group id per sample"):
        grpo(REWARDS, GROUPS[:3])
    with pytest.raises(TypeError, match="integer"):
        rloo(REWARDS, GROUPS.float())


def test_broadcast():
    mask = t([[1, 0, 1], [0, 1, 1]])
    assert torch.equal(broadcast(t([2.0, -1.0]), mask), t([[2, 0, 2], [0, -1, -1]]))


# ------------------------------------------------------------------------------------------- REINFORCE++


# Row 0 has a tool token at t=2 holding a reward of 9 that must be ignored; row 1 ends in a masked 5.
RPP_REWARDS = t([[0, 0.5, 9, 0, 1], [0, 0, 0, 2, 5]])
RPP_MASK = t([[1, 1, 0, 1, 1], [1, 0, 0, 1, 0]])


def test_reinforce_pp_hand_values():
    # gamma = 0.5, returns over policy tokens only:
    # row 0: t4 = 1, t3 = 0.5, (t2 skipped), t1 = 0.5 + 0.5 * 0.5 = 0.75, t0 = 0.375; row 1: t3 = 2, t0 = 1
    # mean of the six = 0.9375, squared deviations sum to 1.6796875, unbiased var = 0.3359375
    std = math.sqrt(0.3359375 + 1e-8)
    expected = t([[-0.5625, -0.1875, 0, -0.4375, 0.0625], [0.0625, 0, 0, 1.0625, 0]]) / std
    assert_close(reinforce_pp(RPP_REWARDS, RPP_MASK, gamma=0.5), expected)


BASE_REWARDS = t([[0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 3, 0]])
BASE_MASK = t([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 0]])
BASE_GROUPS = torch.tensor([0, 0, 1])


def test_reinforce_pp_group_mean_baseline_gamma_one():
    # Totals 1, 0 (group 0, mean 0.5) and 3 (singleton group 1, mean 3): every return shifts by -mean.
    # Masked returns: 0.5 x3, -0.5 x3, 0 x2 -> mean 0, unbiased var = 1.5 / 7
    s = 0.5 / math.sqrt(1.5 / 7 + 1e-8)
    expected = t([[s, s, 0, s], [-s, 0, -s, -s], [0, 0, 0, 0]])
    got = reinforce_pp(BASE_REWARDS, BASE_MASK, gamma=1.0, group_ids=BASE_GROUPS, baseline="group_mean")
    assert_close(got, expected)


def test_reinforce_pp_group_mean_baseline_is_discounted_from_the_last_policy_token():
    # gamma = 0.5: the shifted terminal rewards 0.5 / -0.5 / 0 sit on each row's last policy token.
    # row 0: t3 0.5, t1 0.25, t0 0.125; row 1: t3 -0.5, t2 -0.25, t0 -0.125; row 2: 0, 0
    # mean 0, squared deviations 0.65625, unbiased var 0.09375
    std = math.sqrt(0.09375 + 1e-8)
    expected = t([[0.125, 0.25, 0, 0.5], [-0.125, 0, -0.25, -0.5], [0, 0, 0, 0]]) / std
    got = reinforce_pp(BASE_REWARDS, BASE_MASK, gamma=0.5, group_ids=BASE_GROUPS, baseline="group_mean")
    assert_close(got, expected)


def test_reinforce_pp_validation():
    with pytest.raises(ValueError, match="needs group_ids"):
        reinforce_pp(BASE_REWARDS, BASE_MASK, baseline="group_mean")
    with pytest.raises(ValueError, match="not known"):
        reinforce_pp(BASE_REWARDS, BASE_MASK, baseline="mean")
    with pytest.raises(ValueError, match="gamma"):
        reinforce_pp(BASE_REWARDS, BASE_MASK, gamma=1.5)


# --------------------------------------------------------------------------------------------------- GAE


# Row 0: tool token at t1 (its reward 5 and value 100 must be ignored). Row 1: policy tokens at t0, t1.
GAE_REWARDS = t([[0, 5, 0, 1], [0, 2, 0, 0]])
GAE_VALUES = t([[0.5, 100, 0.2, 0.4], [1.0, 1.5, 0, 0]])
GAE_MASK = t([[1, 0, 1, 1], [1, 1, 0, 0]])


def test_gae_hand_values():
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72); "next" skips the tool token.
    # row 0 deltas: t3 1 - 0.4 = 0.6; t2 0.9 * 0.4 - 0.2 = 0.16; t0 0.9 * 0.2 - 0.5 = -0.32
    #   advantages: t3 0.6; t2 0.16 + 0.72 * 0.6 = 0.592; t0 -0.32 + 0.72 * 0.592 = 0.10624
    # row 1 deltas: t1 2 - 1.5 = 0.5; t0 0.9 * 1.5 - 1.0 = 0.35 -> advantages 0.5, 0.35 + 0.72 * 0.5 = 0.71
    out = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.9, lam=0.8)
    assert_close(out.advantages, t([[0.10624, 0, 0.592, 0.6], [0.71, 0.5, 0, 0]]))
    assert_close(out.returns, t([[0.60624, 0, 0.792, 1.0], [1.71, 2.0, 0, 0]]))
    adv, ret = out  # unpacks like a tuple
    assert adv is out.advantages and ret is out.returns


def test_gae_whiten_whitens_advantages_only():
    plain = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.9, lam=0.8)
    white = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.9, lam=0.8, whiten=True)
    assert_close(white.advantages, masked_whiten(plain.advantages, GAE_MASK))
    assert torch.equal(white.returns, plain.returns)
    assert_close(white.advantages[GAE_MASK.bool()].mean(), torch.tensor(0.0), atol=1e-6, rtol=0)


def test_gae_with_gamma_lam_one_is_return_minus_value():
    # Sum of future policy-token rewards: row 0 -> 1 on every policy token, row 1 -> 2.
    out = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=1.0, lam=1.0)
    assert_close(out.returns, t([[1, 0, 1, 1], [2, 2, 0, 0]]))
    assert_close(out.advantages, t([[0.5, 0, 0.8, 0.6], [1.0, 0.5, 0, 0]]))


# --------------------------------------------------------------------------------------------- per turn


# Row 0: turns 0, 1, 2 with rewards 1, 2, 4 on their last tokens (t2 is an unmasked tool token holding 7).
# Row 1: turn 1 has no policy tokens, padding carries turn id -1; only turn 2 is rewarded (8).
TURN_REWARDS = t([[0, 1, 7, 2, 0, 4], [0, 0, 0, 0, 8, 0]])
TURN_IDS = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 0, 1, 2, 2, -1]])
TURN_MASK = t([[1, 1, 0, 1, 1, 1], [1, 1, 0, 1, 1, 0]])


def test_turn_returns_hand_values():
    # gamma 0.5: row 0 G2 = 4, G1 = 2 + 0.5 * 4 = 4, G0 = 1 + 0.5 * 4 = 3;
    #            row 1 G2 = 8, G1 = 0 + 0.5 * 8 = 4, G0 = 0 + 0.5 * 4 = 2 (an empty turn still discounts)
    got = turn_returns(TURN_REWARDS, TURN_IDS, TURN_MASK, gamma=0.5)
    assert_close(got, t([[3, 3, 0, 4, 4, 4], [2, 2, 0, 8, 8, 0]]))
    assert_close(turn_returns(TURN_REWARDS, TURN_IDS, TURN_MASK), t([[7, 7, 0, 6, 4, 4], [8, 8, 0, 8, 8, 0]]))


def test_grpo_turn_level_hand_values():
    # G0 of the two trajectories (one group): 3 and 2 -> mean 2.5, unbiased std sqrt(0.5)
    got = grpo_turn_level(TURN_REWARDS, TURN_IDS, TURN_MASK, torch.tensor([7, 7]), gamma=0.5)
    centred = t([[0.5, 0.5, 0, 1.5, 1.5, 1.5], [-0.5, -0.5, 0, 5.5, 5.5, 0]])
    assert_close(got, centred / (math.sqrt(0.5) + 1e-6))
    dr = grpo_turn_level(
        TURN_REWARDS, TURN_IDS, TURN_MASK, torch.tensor([7, 7]), gamma=0.5, normalize_std=False
    )
    assert_close(dr, centred)
    single = grpo_turn_level(TURN_REWARDS, TURN_IDS, TURN_MASK, torch.tensor([0, 1]), gamma=0.5)
    assert torch.equal(single, torch.zeros(2, 6))


def _random_trajectories(seed, b=6, n_tokens=9):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, n_tokens, generator=g) > 0.35).float()
    mask[:, 0] = 1.0  # at least one policy token per row
    turn_ids = torch.cumsum((torch.rand(b, n_tokens, generator=g) > 0.7).long(), dim=1)
    return g, mask, turn_ids


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_turn_level_equals_broadcast_grpo_for_one_terminal_reward(seed, normalize_std):
    g, mask, turn_ids = _random_trajectories(seed)
    groups = torch.tensor([4, 4, 4, 8, 8, 1])
    final = torch.randn(6, generator=g)
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(6), last] = final
    got = grpo_turn_level(token_rewards, turn_ids, mask, groups, gamma=1.0, normalize_std=normalize_std)
    assert_close(got, broadcast(grpo(final, groups, normalize_std=normalize_std), mask))


@pytest.mark.parametrize("seed", range(4))
def test_unmasked_positions_never_matter(seed):
    g, mask, turn_ids = _random_trajectories(seed)
    rewards = torch.randn(mask.shape, generator=g)
    values = torch.randn(mask.shape, generator=g)
    hole = ~mask.bool()

    def junk(x):
        return torch.where(hole, torch.full_like(x, 1e6) if x.is_floating_point() else -5, x)

    groups = torch.tensor([0, 0, 1, 1, 1, 2])
    cases = [
        lambda r, v, k: reinforce_pp(r, mask, gamma=0.9),
        lambda r, v, k: reinforce_pp(r, mask, gamma=1.0),
        lambda r, v, k: reinforce_pp(r, mask, gamma=0.9, group_ids=groups, baseline="group_mean"),
        lambda r, v, k: gae(r, v, mask, gamma=0.9, lam=0.7).advantages,
        lambda r, v, k: gae(r, v, mask, gamma=0.9, lam=0.7).returns,
        lambda r, v, k: gae(r, v, mask, gamma=0.9, lam=0.7, whiten=True).advantages,
        lambda r, v, k: turn_returns(r, k, mask, gamma=0.8),
        lambda r, v, k: grpo_turn_level(r, k, mask, groups, gamma=0.8),
    ]
    for fn in cases:
        clean = fn(rewards, values, turn_ids)
        assert torch.equal(clean, fn(junk(rewards), junk(values), junk(turn_ids)))
        assert torch.equal(clean[hole], torch.zeros(int(hole.sum())))
