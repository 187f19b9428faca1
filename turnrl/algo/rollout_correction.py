"""Rollout correction: importance weights and rejection masks for the gap between the policy that sampled the
tokens (the rollout engine) and the policy the trainer computes; pure functions of tensors.

The gap has two sources, both off-policy for the update: numerics (the engine in bf16 with its own kernels, LoRA
merged or not, against the trainer's forward) and staleness (with asynchronous rollouts a token was sampled by
an older policy version). The behaviour policy is whatever sampled each token, so the correction reads the
logprobs the engine recorded per token (`engine_logprobs`), never a recomputation: with `max_staleness > 0`
different turns of one trajectory may come from different versions and each token carries its own.

With rho_t = pi_trainer(y_t) / pi_engine(y_t) (`trainer_logprobs - engine_logprobs` in log space, clamped to
[-20, 20] before any exp, as verl's SAFETY_BOUND):
- importance weights, truncated (TIS: Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training"; verl's `rollout_is`): level "token": w_t = min(rho_t, cap); level "sequence":
  w_i = min(prod_t rho_t, cap) on every token of sequence i. Token weights are biased with low variance;
  the sequence weight is the unbiased one for a sequence-level objective, with high variance.
- rejection masks (verl's `rollout_rs`; two-sided as IcePop, Ling team 2025, "Small leak can sink a great
  ship", which zeroes the gradient of tokens whose ratio leaves [alpha, beta] instead of clipping them): a statistic is kept
  when it lies in [low, high]; level "token": rho_t; "sequence": prod_t rho_t (every token of the sequence
  shares the verdict); "geometric": exp(mean_t log rho_t), the per-token average gap, which does not grow with
  length (Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
  Training-Inference Mismatch"). `low` defaults to 1 / high as verl's.
- veto (verl's `rollout_token_veto_threshold`): a sequence holding any token with rho_t < veto is rejected
  whole: one token the trainer finds nearly impossible (a sampling bug, a numerics blow-up) poisons the
  sequence, whatever its average looks like.
Weights multiply the per-token loss; the keep mask removes tokens from it. Deviation from verl: rejected tokens
get weight 0 but stay in the loss normalizer (turnrl computes pi_old in the update's own forward pass when it
takes one optimizer step per batch, so the count of kept tokens is not known beforehand); the gradient of the
kept tokens is scaled by kept / total, which is 1 when nothing is rejected.
Metrics (`CorrectionMetrics`): mean weight, share of weights the cap truncated, shares of tokens and sequences
rejected (by the mask and by the veto), over the policy tokens given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from turnrl.algo.masked import as_bool_mask, masked_mean, masked_sum, zero_unmasked

__all__ = ["IS_LEVELS", "RS_LEVELS", "Correction", "CorrectionSpec", "correct", "importance_weights",
           "rejection_mask", "veto_mask"]

SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class CorrectionSpec:
    """What to correct: IS weights at `is_level` truncated at `is_cap`; rejection at `rs_level` outside
    [rs_low, rs_high] (rs_low None: 1 / rs_high); the veto below `veto`. None switches a part off."""
    is_level: str | None = None
    is_cap: float = 2.0
    rs_level: str | None = None
    rs_high: float | None = None
    rs_low: float | None = None
    veto: float | None = None

    def __post_init__(self) -> None:
        if self.is_level is not None and self.is_level not in IS_LEVELS:
            raise ValueError(f"IS level {self.is_level!r} is not known; use one of {', '.join(IS_LEVELS)} or None")
        if self.is_cap <= 0:
            raise ValueError(f"is_cap={self.is_cap} must be > 0 (2.0 is usual)")
        if self.rs_level is not None:
            if self.rs_level not in RS_LEVELS:
                raise ValueError(f"rejection level {self.rs_level!r} is not known; use one of "
                                 f"{', '.join(RS_LEVELS)} or None")
            if self.rs_high is None or self.rs_high <= 0:
                raise ValueError(f"rejection at level {self.rs_level!r} needs rs_high > 0 (e.g. 2.0), "
                                 f"got {self.rs_high}")
            if not 0 < self.low <= self.rs_high:
                raise ValueError(f"need 0 < rs_low <= rs_high; got rs_low={self.low}, rs_high={self.rs_high}")
        if self.veto is not None and self.veto <= 0:
            raise ValueError(f"veto={self.veto} must be > 0 (e.g. 1e-4), or None to turn it off")

    @property
    def low(self) -> float:
        if self.rs_low is not None:
            return self.rs_low
        return 1.0 / self.rs_high if self.rs_high else 0.0

    @property
    def active(self) -> bool:
        return self.is_level is not None or self.rs_level is not None or self.veto is not None


class CorrectionMetrics(NamedTuple):
    weight_mean: Tensor  # [] mean IS weight over policy tokens (1 without IS weights)
    truncated_fraction: Tensor  # [] share of policy tokens whose weight the cap truncated
    rejected_token_fraction: Tensor  # [] share of policy tokens removed (mask and veto)
    rejected_seq_fraction: Tensor  # [] share of sequences (with policy tokens) that lost at least one token
    veto_seq_fraction: Tensor  # [] share of sequences the veto rejected


class Correction(NamedTuple):
    weights: Tensor | None  # [B, T] detached IS weights, 1 on unmasked positions; None without IS
    keep: Tensor  # [B, T] bool: policy tokens that stay in the loss
    metrics: CorrectionMetrics


def _log_rho(trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    m = as_bool_mask(mask, trainer_logprobs, "trainer_logprobs")
    as_bool_mask(mask, engine_logprobs, "engine_logprobs")
    diff = trainer_logprobs.detach().float() - engine_logprobs.detach().float()
    return zero_unmasked(diff, m).clamp(-SAFETY_BOUND, SAFETY_BOUND), m


def _per_sequence(log_rho: Tensor, m: Tensor, level: str) -> Tensor:
    """The level's log statistic on every position: [B, T]."""
    if level == "token":
        return log_rho
    stat = masked_sum(log_rho, m, dim=-1) if level == "sequence" else masked_mean(log_rho, m, dim=-1)
    return stat.clamp(-SAFETY_BOUND, SAFETY_BOUND)[:, None].expand_as(log_rho)


def importance_weights(
    trainer_logprobs: Tensor,  # [B, T]
    engine_logprobs: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    level: str = "token",
    cap: float = 2.0,
) -> Tensor:  # [B, T] detached, 1 on unmasked positions
    """Truncated IS weights: min(rho_t, cap) ("token") or min(prod_t rho_t, cap) on each token ("sequence")."""
    if level not in IS_LEVELS:
        raise ValueError(f"IS level {level!r} is not known; use one of {', '.join(IS_LEVELS)}")
    if cap <= 0:
        raise ValueError(f"cap={cap} must be > 0 (2.0 is usual)")
    log_rho, m = _log_rho(trainer_logprobs, engine_logprobs, mask)
    log_w = _per_sequence(log_rho, m, level).clamp(max=math.log(cap))
    return torch.where(m, torch.exp(log_w), torch.ones((), dtype=log_w.dtype, device=log_w.device))


def rejection_mask(
    trainer_logprobs: Tensor,  # [B, T]
    engine_logprobs: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    level: str,
    high: float,
    low: float | None = None,
) -> Tensor:  # [B, T] bool: kept policy tokens
    """Keep policy tokens whose statistic (rho_t, prod rho or geometric mean) lies in [low, high]."""
    spec = CorrectionSpec(rs_level=level, rs_high=high, rs_low=low)
    log_rho, m = _log_rho(trainer_logprobs, engine_logprobs, mask)
    stat = _per_sequence(log_rho, m, level)
    inside = (stat >= math.log(spec.low)) & (stat <= math.log(high))
    return m & inside


def veto_mask(
    trainer_logprobs: Tensor,  # [B, T]
    engine_logprobs: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    threshold: float,
) -> Tensor:  # [B, T] bool: policy tokens of sequences without a catastrophic token
    """Reject every token of a sequence that has one policy token with rho_t < threshold."""
    if threshold <= 0:
        raise ValueError(f"veto threshold {threshold} must be > 0 (e.g. 1e-4)")
    log_rho, m = _log_rho(trainer_logprobs, engine_logprobs, mask)
    catastrophic = ((log_rho < math.log(threshold)) & m).any(dim=-1, keepdim=True)
    return m & ~catastrophic


def correct(
    trainer_logprobs: Tensor,  # [B, T] the trainer's logprobs of the sampled tokens (pi_old)
    engine_logprobs: Tensor,  # [B, T] what the engine recorded when it sampled them
    mask: Tensor,  # [B, T]
    spec: CorrectionSpec,
) -> Correction:
    """IS weights, keep mask and metrics for `spec`; see the module docstring."""
    m = as_bool_mask(mask, trainer_logprobs, "trainer_logprobs")
    weights = None
    keep = m
    vetoed = torch.zeros(m.shape[0], dtype=torch.bool, device=m.device)
    with torch.no_grad():
        if spec.is_level is not None:
            weights = importance_weights(trainer_logprobs, engine_logprobs, m, spec.is_level, spec.is_cap)
        if spec.rs_level is not None:
            assert spec.rs_high is not None
            keep = keep & rejection_mask(trainer_logprobs, engine_logprobs, m, spec.rs_level, spec.rs_high, spec.low)
        if spec.veto is not None:
            vetoed_mask = veto_mask(trainer_logprobs, engine_logprobs, m, spec.veto)
            vetoed = m.any(dim=-1) & ~vetoed_mask.any(dim=-1)
            keep = keep & vetoed_mask
        floats = torch.float32
        has = m.any(dim=-1)
        n_seq = has.sum().clamp(min=1).to(floats)
        if weights is not None:
            log_rho, _ = _log_rho(trainer_logprobs, engine_logprobs, m)
            raw = _per_sequence(log_rho, m, spec.is_level)
            truncated = masked_mean((raw > math.log(spec.is_cap)).to(floats), m)
            weight_mean = masked_mean(weights.to(floats), m)
        else:
            truncated = torch.zeros((), dtype=floats, device=m.device)
            weight_mean = torch.ones((), dtype=floats, device=m.device)
        lost = m & ~keep
        metrics = CorrectionMetrics(
            weight_mean=weight_mean,
            truncated_fraction=truncated,
            rejected_token_fraction=masked_mean(lost.to(floats), m),
            rejected_seq_fraction=(lost.any(dim=-1) & has).sum().to(floats) / n_seq,
            veto_seq_fraction=vetoed.sum().to(floats) / n_seq,
        )
    return Correction(weights, keep, metrics)
