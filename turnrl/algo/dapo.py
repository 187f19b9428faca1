"""DAPO's data-side pieces (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv:2503.14476); pure functions. Its loss-side pieces are elsewhere: clip-higher is `clip_high` of
`turnrl.algo.losses.ppo_policy_loss`, the token-level loss is `aggregate(..., "token-mean")`.

- `groups_with_signal` (dynamic sampling, the paper's eq. 11 constraint 0 < |{o_i : is_equivalent(a, o_i)}| < G):
  a group whose samples all score the same has zero advantage under GRPO and adds nothing but dilution to the
  batch, so it is dropped and more prompts are sampled. "The same" is exact equality of the filter metric
  (verl compares the group std with 0). A group of one sample is kept, as verl keeps it: it cannot be
  compared with anything, and dropping it would make `rollout.n=1` loop forever.
- `overlong_penalty` (soft overlong punishment, the paper's eq. 13): with L the response length, L_max the
  limit and L_cache the buffer before it, R_length = 0 for L <= L_max - L_cache, (L_max - L_cache - L) /
  L_cache inside the buffer, -1 beyond L_max; scaled by `factor` (verl's penalty_factor), added to the reward.
  verl's DAPO reward manager computes min(-(L - (L_max - L_cache)) / L_cache * factor, 0), which is the same
  up to L_max and keeps falling past it (its responses never pass L_max); turnrl clamps at -factor, as the paper.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["groups_with_signal", "overlong_penalty"]


def groups_with_signal(values: Tensor, group_ids: Tensor) -> Tensor:  # values [B], group_ids [B] -> [B] bool
    """True for each sample whose group's values are not all equal (or whose group has one sample)."""
    if values.dim() != 1 or group_ids.shape != values.shape:
        raise ValueError(f"need values [B] and group_ids [B]; got {tuple(values.shape)} and "
                         f"{tuple(group_ids.shape)}")
    if group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise TypeError(f"group_ids must be an integer tensor (got {group_ids.dtype}); e.g. torch.long")
    if values.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=values.device)
    _, inv = torch.unique(group_ids, return_inverse=True)
    n = int(inv.max()) + 1
    v = values.double()
    lo = torch.full((n,), float("inf"), dtype=v.dtype, device=v.device).scatter_reduce(0, inv, v, "amin")
    hi = torch.full((n,), float("-inf"), dtype=v.dtype, device=v.device).scatter_reduce(0, inv, v, "amax")
    size = torch.zeros(n, dtype=torch.long, device=v.device).index_add(0, inv, torch.ones_like(inv))
    return ((hi > lo) | (size == 1))[inv]


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:  # [B] -> [B]
    """DAPO's soft overlong punishment per response length: 0, then linear to -factor over the buffer."""
    if max_len <= 0 or not 0 < buffer <= max_len:
        raise ValueError(f"need 0 < buffer <= max_len; got buffer={buffer}, max_len={max_len} (the buffer is "
                         "the last tokens before the response limit)")
    if factor < 0:
        raise ValueError(f"factor={factor} must be >= 0 (1.0 in the paper)")
    expected = max_len - buffer
    excess = lengths.double() - expected
    return (-(excess / buffer) * factor).clamp(min=-factor, max=0.0)
