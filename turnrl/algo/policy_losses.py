"""Policy losses beyond PPO's token clip: GSPO, CISPO and GMPO; pure functions of tensors, and the name table.

Same conventions as `turnrl.algo.losses`: every loss is a quantity to MINIMISE, `mask` [B, T] marks the policy
tokens, values under mask 0 never reach a result or a gradient, `normalizer` makes gradient accumulation exact
(see `aggregate`), `is_weights` [B, T] (rollout correction, `turnrl.algo.rollout_correction`) multiply the
per-token loss, detached. Below r_t = pi_theta(y_t) / pi_old(y_t), computed from log-ratios clamped to
[-20, 20] before exp, A the advantage.

- `gspo_policy_loss`: GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071). One
  importance ratio per sequence, length-normalised: s_i = exp(1/|y_i| sum_t log r_t) (the geometric mean of
  the token ratios), clipped at the sequence level: J = mean_i min(s_i A_i, clip(s_i, 1 - eps_low,
  1 + eps_high) A_i). Implemented as the paper's GSPO-token form s_i,t = sg[s_i] * pi_theta(y_t) /
  sg[pi_theta(y_t)], whose value is s_i on every token and whose gradient equals GSPO's when A is constant
  over the sequence (it is for the outcome estimators), so per-token advantages (turn-level returns) also
  work. The paper's objective averages tokens within a sequence, then sequences: use it with
  `agg="seq-mean-token-mean"` (the config requires it, as verl hard-codes it). The paper's clip range is
  eps_low = 3e-4, eps_high = 4e-4 (sequence ratios sit much closer to 1 than token ratios). The log of s_i is
  clamped to <= 10 as verl does. Multi-turn: a "sequence" is a row of the batch, i.e. the policy tokens of a
  trajectory (of a segment, for trajectories split by the context limit); tool and user tokens do not enter
  the geometric mean.
- `cispo_policy_loss`: CISPO (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585). REINFORCE with a clipped,
  stop-gradient importance weight, so no token ever loses its gradient to clipping:
  loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * log pi_theta(y_t). The paper clips only from
  above (eps_low large: set clip_low = 1.0 for no lower bound, allowed here); verl clips both sides with its
  clip_ratio_low/high, which is what turnrl's defaults give. The loss value is not comparable with PPO's
  (it is -A * log pi), its gradient is: with one epoch and one mini-batch (r = 1) both are the plain policy
  gradient.
- `gmpo_policy_loss`: GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673), verl's
  `geo_mean`. The geometric mean of token ratios, each clipped in log space on the side that matters for the
  sign of A: l_t = sgn(A) * min(sgn(A) log r_t, sgn(A) clip(log r_t, -eps_low, eps_high)), per-sequence
  loss -A_i * exp(1/|y_i| sum_t l_t), averaged over the sequences that have policy tokens (verl's mean also
  counts empty rows). A_i is the mean of the row's token advantages
  (GMPO is defined for one advantage per sequence). eps are log-space bounds (the paper uses 0.4 both ways,
  i.e. ratios in (e^-0.4, e^0.4)). IS weights enter as their per-sequence geometric mean, as verl does. Needs
  a sequence-count normalizer: use `agg="seq-mean-token-mean"`.

`POLICY_LOSSES` maps `algo.loss_mode` names to functions with one signature; `ppo` is
`turnrl.algo.losses.ppo_policy_loss` (the only one with dual clip).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from turnrl.algo.losses import AggMode, PolicyLossOutput, aggregate, ppo_policy_loss
from turnrl.algo.masked import as_bool_mask, masked_mean, masked_sum, zero_unmasked

__all__ = ["LOSS_MODES", "POLICY_LOSSES", "cispo_policy_loss", "gmpo_policy_loss", "gspo_policy_loss", "policy_loss"]

_LOG_CLAMP = 20.0


def _check(mask: Tensor, **tensors: Tensor) -> Tensor:
    m = None
    for name, x in tensors.items():
        m = as_bool_mask(mask, x, name)
    assert m is not None
    return m


def _check_clip(clip_low: float, clip_high: float, max_low: float = 1.0) -> None:
    if not 0.0 <= clip_low <= max_low or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low <= {max_low} and clip_high >= 0; got {clip_low=}, {clip_high=}")


def _weights(is_weights: Tensor | None, mask: Tensor, m: Tensor) -> Tensor | None:
    if is_weights is None:
        return None
    as_bool_mask(mask, is_weights, "is_weights")
    return zero_unmasked(is_weights.detach(), m)


def _weighted_loss(loss_mat: Tensor, is_weights: Tensor | None, mask: Tensor, m: Tensor, agg: AggMode,
                   normalizer: float | int | Tensor | None) -> Tensor:
    """The per-token loss times the rollout-correction weights (when given), aggregated."""
    w = _weights(is_weights, mask, m)
    return aggregate(loss_mat if w is None else loss_mat * w, m, agg, normalizer)


def _output(loss: Tensor, clip_fraction: Tensor, approx_kl: Tensor, ratio_mean: Tensor) -> PolicyLossOutput:
    """These losses have no dual clip: its share is zero."""
    return PolicyLossOutput(loss=loss, clip_fraction=clip_fraction, approx_kl=approx_kl, ratio_mean=ratio_mean,
                            dual_clip_fraction=torch.zeros((), dtype=approx_kl.dtype, device=approx_kl.device))


def gspo_policy_loss(
    logprobs: Tensor,  # [B, T] current policy, differentiable
    old_logprobs: Tensor,  # [B, T]
    advantages: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: AggMode = "seq-mean-token-mean",
    normalizer: float | int | Tensor | None = None,
    is_weights: Tensor | None = None,  # [B, T]
) -> PolicyLossOutput:
    """GSPO: sequence-level, length-normalised importance ratio with sequence-level clipping."""
    m = _check(mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    _check_clip(clip_low, clip_high, max_low=1.0)
    log_ratio = zero_unmasked(logprobs - old_logprobs.detach(), m).clamp(-_LOG_CLAMP, _LOG_CLAMP)
    log_seq = masked_mean(log_ratio, m, dim=-1).detach()  # [B]
    lp = zero_unmasked(logprobs, m)
    # value log s_i on every token; gradient d log pi_theta(y_t)
    log_s = (lp - lp.detach() + log_seq[:, None]).clamp(max=10.0)
    s = torch.exp(log_s)
    adv = zero_unmasked(advantages.detach(), m)
    unclipped = -adv * s
    clipped = -adv * s.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = _weighted_loss(torch.maximum(unclipped, clipped), is_weights, mask, m, agg, normalizer)
    with torch.no_grad():
        return _output(loss, masked_mean((clipped > unclipped).to(s.dtype), m),
                       masked_mean(torch.exp(log_ratio) - 1.0 - log_ratio, m), masked_mean(s.detach(), m))


def cispo_policy_loss(
    logprobs: Tensor,  # [B, T] current policy, differentiable
    old_logprobs: Tensor,  # [B, T]
    advantages: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    agg: AggMode = "token-mean",
    normalizer: float | int | Tensor | None = None,
    is_weights: Tensor | None = None,  # [B, T]
) -> PolicyLossOutput:
    """CISPO: -sg(clip(r)) * A * log pi per token; clip_low = 1.0 removes the lower bound (the paper's choice)."""
    m = _check(mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    _check_clip(clip_low, clip_high, max_low=1.0)
    lp = zero_unmasked(logprobs, m)
    log_ratio = zero_unmasked(logprobs.detach() - old_logprobs.detach(), m).clamp(-_LOG_CLAMP, _LOG_CLAMP)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    adv = zero_unmasked(advantages.detach(), m)
    loss = _weighted_loss(-weight * adv * lp, is_weights, mask, m, agg, normalizer)
    with torch.no_grad():
        return _output(loss, masked_mean((weight != ratio).to(ratio.dtype), m),
                       masked_mean(ratio - 1.0 - log_ratio, m), masked_mean(ratio, m))


def gmpo_policy_loss(
    logprobs: Tensor,  # [B, T] current policy, differentiable
    old_logprobs: Tensor,  # [B, T]
    advantages: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    agg: AggMode = "seq-mean-token-mean",
    normalizer: float | int | Tensor | None = None,
    is_weights: Tensor | None = None,  # [B, T]
) -> PolicyLossOutput:
    """GMPO: -A_i * geometric mean of the sign-aware log-clipped token ratios, averaged over sequences."""
    m = _check(mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    _check_clip(clip_low, clip_high, max_low=float("inf"))
    if agg == "token-mean":
        raise ValueError("GMPO averages over sequences: use agg='seq-mean-token-mean' (or seq-mean-token-sum)")
    log_ratio = zero_unmasked(logprobs - old_logprobs.detach(), m).clamp(-_LOG_CLAMP, _LOG_CLAMP)
    adv_tok = zero_unmasked(advantages.detach(), m)
    sign = torch.sign(adv_tok)
    bounded = log_ratio.clamp(-clip_low, clip_high)
    clipped_log = sign * torch.minimum(sign * log_ratio, sign * bounded)
    has = m.any(dim=-1)
    seq_log = masked_mean(clipped_log, m, dim=-1)  # [B]
    seq_adv = masked_mean(adv_tok, m, dim=-1)  # [B]
    seq_loss = -seq_adv * torch.exp(seq_log)
    w = _weights(is_weights, mask, m)
    if w is not None:
        log_w = torch.log(torch.where(m, w, torch.ones_like(w)).clamp(min=1e-10))
        seq_loss = seq_loss * torch.exp(masked_mean(log_w, m, dim=-1))
    seq_loss = torch.where(has, seq_loss, torch.zeros_like(seq_loss))
    count = has.sum().clamp(min=1).to(seq_loss.dtype)
    loss = seq_loss.sum() / (count if normalizer is None else normalizer)
    with torch.no_grad():
        clipped = (log_ratio != bounded) & m
        return _output(loss, masked_sum(clipped.to(log_ratio.dtype), m) / m.sum().clamp(min=1),
                       masked_mean(torch.exp(log_ratio) - 1.0 - log_ratio, m),
                       masked_mean(torch.exp(seq_log)[:, None].expand_as(log_ratio), m))


PolicyLoss = Callable[..., PolicyLossOutput]
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": ppo_policy_loss,
    "gspo": gspo_policy_loss,
    "cispo": cispo_policy_loss,
    "gmpo": gmpo_policy_loss,
}
LOSS_MODES: tuple[str, ...] = tuple(POLICY_LOSSES)


def policy_loss(
    mode: str,
    logprobs: Tensor,  # [B, T]
    old_logprobs: Tensor,  # [B, T]
    advantages: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    agg: AggMode = "token-mean",
    normalizer: float | int | Tensor | None = None,
    is_weights: Tensor | None = None,  # [B, T]
) -> PolicyLossOutput:
    """The loss named `mode` (see `POLICY_LOSSES`); dual clip belongs to ppo alone."""
    fn = POLICY_LOSSES.get(mode)
    if fn is None:
        raise ValueError(f"loss mode {mode!r} is not known; use one of {', '.join(LOSS_MODES)}")
    if mode == "ppo":
        return ppo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual_clip, agg,
                               normalizer, is_weights)
    if dual_clip is not None:
        raise ValueError(f"dual_clip is a PPO setting; loss mode {mode!r} does not use it: set algo.dual_clip=null")
    return fn(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, agg, normalizer, is_weights)
