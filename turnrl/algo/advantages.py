"""Advantage estimators: pure functions from rewards (and values) to per-sample or per-token advantages.

Shapes: B = trajectories (samples), T = tokens. `mask` [B, T] marks the policy's own tokens (1) against
prompt, tool-output, user and padding tokens (0). In a multi-turn trajectory the 0-positions sit *between*
policy tokens, so every token-level estimator here walks the masked positions only: an unmasked position
neither receives a return nor breaks the chain of returns, and rewards or values stored under it are
ignored (put rewards on policy tokens, e.g. the last token of a turn). Outputs are 0 on unmasked positions.
`group_ids` [B] are integer ids of the prompt each sample answers; any values, not necessarily contiguous.

Estimators and references:
- `grpo`: GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300), A_i = (r_i - mean_g) / (std_g + eps)
  with the unbiased (n - 1) std, as verl computes it with torch.std. normalize_std=False is Dr. GRPO
  (Liu et al. 2025, arXiv:2503.20783): A_i = r_i - mean_g. Deviation from verl: a group of one sample gets
  advantage 0 (verl uses mean 0, std 1 there, i.e. A = r), since one sample carries no relative signal.
- `rloo`: REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740),
  A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_g); a group of one gets 0.
- `reinforce_pp`: REINFORCE++ (Hu 2025, arXiv:2501.03262): token returns G_t = r_t + gamma * G_next over
  policy tokens, then whitened over every policy token of the batch. baseline="group_mean" is
  REINFORCE++-baseline: each trajectory's total reward R_i = sum of its token rewards; the group mean
  m_g = mean_{j in g} R_j is subtracted from the reward of the trajectory's *last* policy token before
  the returns are computed. With gamma = 1 this shifts every token's return by exactly -m_g (the same as
  the paper's r_i - mean_g on an outcome reward); with gamma < 1 the shift is discounted like the reward it
  offsets. Rows without policy tokens are left alone. The KL term of the paper is not folded in here: add
  it to `token_rewards` before calling if it belongs in the reward.
- `gae`: generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438) with
  delta_t = r_t + gamma * V(next) - V_t, A_t = delta_t + gamma * lam * A(next), where "next" is the next
  policy token of the same row, and V(next) = 0 after the last one (the trajectory is treated as
  terminated; a truncated one would need a bootstrap value, which this function does not take).
  returns = A + V. whiten=True whitens A over the mask after the returns are formed (as verl does).
- `turn_returns`: per-turn discounting for multi-turn credit. R_k = sum of the rewards of turn k's policy
  tokens; G_t = sum_{k >= t} gamma^(k - t) R_k, with k - t the difference of turn ids *as given* (turns with
  no policy tokens still count as a step of discount). Every policy token of turn t gets G_t.
- `grpo_turn_level`: our variant for multi-turn GRPO: each token gets (G_turn - mean_g(G_0)) /
  (std_g(G_0) + eps), the per-turn return centred and scaled by the group statistics of the trajectories'
  whole returns G_0 (the return of turn 0). Turns are not aligned across the samples of a group (they have
  different lengths and contents), so per-turn-position statistics would compare unlike things; the
  trajectory-level baseline is the one well-defined comparison. With one terminal reward and gamma = 1 every
  G_turn equals G_0 and this is exactly broadcast(grpo(...)). A group of one sample gets 0, as in `grpo`.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from turnrl.algo.masked import as_bool_mask, masked_whiten, zero_unmasked

__all__ = [
    "GAEOutput",
    "broadcast",
    "gae",
    "grpo",
    "grpo_turn_level",
    "reinforce_pp",
    "rloo",
    "turn_returns",
]


class GAEOutput(NamedTuple):
    advantages: Tensor  # [B, T], 0 on unmasked positions
    returns: Tensor  # [B, T], advantages + values (before any whitening), 0 on unmasked positions


# ---------------------------------------------------------------------------------------------- helpers


def _check_rows(name: str, x: Tensor, mask: Tensor) -> Tensor:
    if x.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; it must be [B, T] like the mask")
    return as_bool_mask(mask, x, name)


def _float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.float()


def _check_discount(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value} is outside [0, 1]; use a discount such as 1.0 or 0.99")


def _group_stats(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group mean, unbiased group std, group size) of `values` [B]; each output [B]."""
    if values.dim() != 1 or group_ids.shape != values.shape:
        raise ValueError(
            f"group_ids has shape {tuple(group_ids.shape)} but the per-sample values have shape "
            f"{tuple(values.shape)}; pass one group id per sample, shape [B]"
        )
    if group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise TypeError(f"group_ids must be an integer tensor (got {group_ids.dtype}); e.g. torch.long")
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    zeros = values.new_zeros(n_groups)
    count = zeros.index_add(0, inv, torch.ones_like(values))
    mean = zeros.index_add(0, inv, values) / count
    sq = zeros.index_add(0, inv, (values - mean[inv]) ** 2)
    # Singleton groups: clamp avoids 0/0; their advantages are zeroed by the callers anyway.
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return mean[inv], std[inv], count[inv]


def _masked_discounted_cumsum(x: Tensor, mask: Tensor, discount: float) -> Tensor:
    """out_t = x_t + discount * out_next over the masked positions of each row. [B, T] -> [B, T]."""
    if discount == 1.0:
        # Undiscounted returns are a reverse cumsum: one kernel instead of T small ones on long rows.
        return zero_unmasked(zero_unmasked(x, mask).flip(1).cumsum(1).flip(1), mask)
    out = torch.zeros_like(x)
    running = x.new_zeros(x.shape[0])
    for t in range(x.shape[1] - 1, -1, -1):
        m = mask[:, t]
        running = torch.where(m, x[:, t] + discount * running, running)
        out[:, t] = torch.where(m, running, 0.0)
    return out


def _next_masked_value(values: Tensor, mask: Tensor) -> Tensor:
    """Value at the next masked position of the same row, 0 after the last one. [B, T] -> [B, T]."""
    out = torch.zeros_like(values)
    nxt = values.new_zeros(values.shape[0])
    for t in range(values.shape[1] - 1, -1, -1):
        out[:, t] = nxt
        nxt = torch.where(mask[:, t], values[:, t], nxt)
    return out


# ------------------------------------------------------------------------------------ outcome estimators


def grpo(
    rewards: Tensor,  # [B]
    group_ids: Tensor,  # [B] long
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:  # [B]
    """GRPO advantages (r - group mean) / (group std + eps); Dr. GRPO when normalize_std=False."""
    rewards = _float(rewards)
    mean, std, count = _group_stats(rewards, group_ids)
    adv = rewards - mean
    if normalize_std:
        adv = adv / (std + eps)
    return torch.where(count > 1, adv, 0.0)


def rloo(rewards: Tensor, group_ids: Tensor) -> Tensor:  # rewards [B], group_ids [B] -> [B]
    """Leave-one-out advantages r_i - mean of the other samples of the group; 0 for a group of one."""
    rewards = _float(rewards)
    mean, _, count = _group_stats(rewards, group_ids)
    adv = count / (count - 1).clamp(min=1) * (rewards - mean)
    return torch.where(count > 1, adv, 0.0)


def broadcast(seq_values: Tensor, mask: Tensor) -> Tensor:  # seq_values [B], mask [B, T] -> [B, T]
    """Give every policy token its sequence's value; 0 on unmasked positions."""
    if seq_values.dim() != 1 or mask.dim() != 2 or mask.shape[0] != seq_values.shape[0]:
        raise ValueError(
            f"broadcast needs seq_values [B] and mask [B, T]; got {tuple(seq_values.shape)} and "
            f"{tuple(mask.shape)}"
        )
    m = mask if mask.dtype == torch.bool else mask != 0
    return zero_unmasked(_float(seq_values)[:, None].expand(m.shape), m)


# ------------------------------------------------------------------------------- token-level estimators


def reinforce_pp(
    token_rewards: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    gamma: float = 1.0,
    group_ids: Tensor | None = None,  # [B] long, required for baseline="group_mean"
    baseline: Literal["none", "group_mean"] = "none",
) -> Tensor:  # [B, T]
    """REINFORCE++ advantages: discounted returns over policy tokens, whitened over the whole batch."""
    m = _check_rows("token_rewards", token_rewards, mask)
    _check_discount("gamma", gamma)
    rewards = zero_unmasked(_float(token_rewards), m)
    if baseline == "group_mean":
        if group_ids is None:
            raise ValueError('baseline="group_mean" needs group_ids (one integer id per trajectory, [B])')
        group_mean, _, _ = _group_stats(rewards.sum(dim=1), group_ids)
        has_tokens = m.any(dim=1)
        # Index of the last policy token of each row (rows without one are skipped below).
        last = m.shape[1] - 1 - m.flip(dims=[1]).to(torch.int8).argmax(dim=1)
        rows = torch.arange(m.shape[0], device=m.device)
        rewards = rewards.clone()
        rewards[rows[has_tokens], last[has_tokens]] -= group_mean[has_tokens]
    elif baseline != "none":
        raise ValueError(f'baseline={baseline!r} is not known; use "none" or "group_mean"')
    returns = _masked_discounted_cumsum(rewards, m, gamma)
    return masked_whiten(returns, m)


def gae(
    token_rewards: Tensor,  # [B, T]
    values: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = False,
) -> GAEOutput:
    """GAE over the policy tokens of each row; see the module docstring for the exact recursion."""
    m = _check_rows("token_rewards", token_rewards, mask)
    _check_rows("values", values, mask)
    _check_discount("gamma", gamma)
    _check_discount("lam", lam)
    rewards = zero_unmasked(_float(token_rewards), m)
    v = zero_unmasked(_float(values), m)
    deltas = rewards + gamma * _next_masked_value(v, m) - v
    advantages = _masked_discounted_cumsum(deltas, m, gamma * lam)
    returns = zero_unmasked(advantages + v, m)
    if whiten:
        advantages = masked_whiten(advantages, m)
    return GAEOutput(advantages=advantages, returns=returns)


def _per_turn_returns(
    token_rewards: Tensor, turn_ids: Tensor, mask: Tensor, gamma: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(G [B, K] per-turn returns, turn index [B, T] safe to gather with, bool mask [B, T])."""
    m = _check_rows("token_rewards", token_rewards, mask)
    _check_rows("turn_ids", turn_ids, mask)
    _check_discount("gamma", gamma)
    if turn_ids.is_floating_point() or turn_ids.dtype == torch.bool:
        raise TypeError(f"turn_ids must be an integer tensor (got {turn_ids.dtype}); e.g. torch.long")
    # Unmasked positions may carry any id (-1 for padding, say); they are parked on turn 0 with reward 0.
    turns = torch.where(m, turn_ids, 0).long()
    if bool((turns < 0).any()):
        raise ValueError("turn_ids of policy tokens must be >= 0 (turn 0 is the first turn)")
    n_turns = int(turns.max()) + 1 if turns.numel() else 1
    rewards = zero_unmasked(_float(token_rewards), m)
    per_turn = rewards.new_zeros(rewards.shape[0], n_turns).scatter_add(1, turns, rewards)  # [B, K]
    returns = torch.zeros_like(per_turn)
    running = per_turn.new_zeros(per_turn.shape[0])
    for k in range(n_turns - 1, -1, -1):
        running = per_turn[:, k] + gamma * running
        returns[:, k] = running
    return returns, turns, m


def turn_returns(
    token_rewards: Tensor,  # [B, T]
    turn_ids: Tensor,  # [B, T] long, turn index of each token
    mask: Tensor,  # [B, T]
    gamma: float = 1.0,
) -> Tensor:  # [B, T]
    """Per-turn discounted returns G_t = sum_{k >= t} gamma^(k - t) R_k on every policy token of turn t."""
    returns, turns, m = _per_turn_returns(token_rewards, turn_ids, mask, gamma)
    return zero_unmasked(returns.gather(1, turns), m)


def grpo_turn_level(
    token_rewards: Tensor,  # [B, T]
    turn_ids: Tensor,  # [B, T] long
    mask: Tensor,  # [B, T]
    group_ids: Tensor,  # [B] long
    gamma: float = 1.0,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:  # [B, T]
    """Per-turn returns normalised by the group statistics of whole-trajectory returns G_0."""
    returns, turns, m = _per_turn_returns(token_rewards, turn_ids, mask, gamma)
    mean, std, count = _group_stats(returns[:, 0], group_ids)
    adv = returns.gather(1, turns) - mean[:, None]
    if normalize_std:
        adv = adv / (std[:, None] + eps)
    adv = torch.where((count > 1)[:, None], adv, 0.0)
    return zero_unmasked(adv, m)

