"""Policy-gradient losses, KL penalties and the token maths under them: pure functions of tensors.

Sign convention: every loss returned here is a quantity to MINIMISE (call `.backward()` on it directly);
the policy loss is the negated PPO objective. Shapes: B = sequences, T = tokens, V = vocabulary. `mask`
[B, T] marks the policy tokens; values under mask 0 never reach a result or a gradient (inputs are
replaced with `torch.where` before any arithmetic, so NaN/inf there cannot leak through `0 * nan`).

- `aggregate` turns a [B, T] loss matrix into a scalar ("token-mean", "seq-mean-token-sum",
  "seq-mean-token-mean", the modes verl offers). Deviation from verl: the seq modes average over
  sequences with at least one policy token, so an empty (failed) trajectory does not dilute the mean.
  `normalizer` makes gradient accumulation exact: pass the number of policy tokens in the whole
  mini-batch (token-mean) or of sequences with >= 1 policy token in it (seq modes); each micro-batch then
  returns its share, and the shares sum to the loss of the whole mini-batch.
- `ppo_policy_loss`: PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with decoupled clip
  bounds 1 - clip_low / 1 + clip_high (DAPO's clip-higher, Yu et al. 2025, arXiv:2503.14476) and optional
  dual clip (Ye et al. 2020, arXiv:1912.09729): for A < 0 the per-token loss is capped at -dual_clip * A,
  so a token whose ratio exploded cannot dominate. The log-ratio is clamped to [-20, 20] before exp, as
  verl does, to keep the ratio finite. `is_weights` (e.g. from `truncated_is_weights`) multiply the
  per-token loss, detached. Metrics are detached token means over the mask; approx_kl is Schulman's k3
  estimate of KL(pi_old || pi_new) from samples of pi_old: ratio - 1 - log(ratio).
- `kl_penalty`: Schulman's estimators (http://joschu.net/blog/kl-approx.html) of KL(pi || pi_ref) from
  samples of pi, with log_ratio = logp - ref: k1 = log_ratio; k2 ("mse") = 0.5 * log_ratio^2;
  k3 ("low_var_kl") = exp(-log_ratio) - 1 + log_ratio, with -log_ratio clamped to [-20, 20] before exp and
  the result clamped to [-10, 10] as verl's low_var_kl does.
- `truncated_is_weights`: truncated importance sampling for the rollout-engine / trainer mismatch (Yao et
  al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"):
  w = min(pi_trainer / pi_engine, cap), computed as exp(min(log-ratio, log cap)) so it never overflows.
- `value_loss`: PPO's clipped value loss 0.5 * max((v - R)^2, (old + clip(v - old, +-clip) - R)^2).
- `entropy_from_logits` / `logprobs_from_logits`: chunked over T and upcast to float32 one chunk at a
  time, so a bf16 [B, T, V] tensor is never copied whole in float32; logprobs are
  logit[label] - logsumexp(logits), never a full log_softmax. Logits must be finite.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from turnrl.algo.masked import as_bool_mask, masked_mean, masked_sum, zero_unmasked

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "PolicyLossOutput",
    "aggregate",
    "entropy_from_logits",
    "kl_penalty",
    "logprobs_from_logits",
    "ppo_policy_loss",
    "truncated_is_weights",
    "value_loss",
]

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
# Aliases map onto the canonical estimator names k1 / k2 / k3.
KL_KINDS: dict[str, str] = {"k1": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}


class PolicyLossOutput(NamedTuple):
    loss: Tensor  # [] differentiable, to minimise
    clip_fraction: Tensor  # [] share of policy tokens where the ratio clip was active
    approx_kl: Tensor  # [] k3 estimate of KL(pi_old || pi_new), mean over policy tokens
    ratio_mean: Tensor  # [] mean of pi_new / pi_old over policy tokens
    dual_clip_fraction: Tensor  # [] share of policy tokens where the dual-clip cap was active


def aggregate(
    loss_mat: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    mode: AggMode = "token-mean",
    normalizer: float | int | Tensor | None = None,
) -> Tensor:  # []
    """Reduce a per-token loss to a scalar; `normalizer` replaces the local token/sequence count."""
    m = as_bool_mask(mask, loss_mat, "loss_mat")
    # A tensor normalizer is not checked: reading it would force a device sync on every micro-batch.
    if normalizer is not None and not isinstance(normalizer, Tensor) and normalizer <= 0:
        raise ValueError(
            f"normalizer={normalizer} must be > 0: pass the mini-batch's count of policy tokens "
            "(token-mean) or of sequences with policy tokens (seq modes)"
        )
    if mode == "token-mean":
        total = masked_sum(loss_mat, m)
        count = m.sum().clamp(min=1)
    elif mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        reduce = masked_sum if mode == "seq-mean-token-sum" else masked_mean
        per_seq = reduce(loss_mat, m, dim=-1)
        # A sequence with no policy token already sums to 0; only the count must leave it out.
        total = per_seq.sum()
        count = m.any(dim=-1).sum().clamp(min=1)
    else:
        raise ValueError(f"agg mode {mode!r} is not known; use one of {', '.join(AGG_MODES)}")
    return total / (count.to(total.dtype) if normalizer is None else normalizer)


def ppo_policy_loss(
    logprobs: Tensor,  # [B, T] current policy, differentiable
    old_logprobs: Tensor,  # [B, T] policy that sampled (or recomputed by the trainer)
    advantages: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    clip_low: float = 0.2,
    clip_high: float = 0.28,  # DAPO's clip-higher; the same default as `algo.clip_high`
    dual_clip: float | None = None,
    agg: AggMode = "token-mean",
    normalizer: float | int | Tensor | None = None,
    is_weights: Tensor | None = None,  # [B, T]
) -> PolicyLossOutput:
    """PPO clipped surrogate (to minimise) with clip-higher, optional dual clip and IS weights."""
    m = as_bool_mask(mask, logprobs, "logprobs")
    as_bool_mask(mask, old_logprobs, "old_logprobs")
    as_bool_mask(mask, advantages, "advantages")
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0; got {clip_low=}, {clip_high=}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1 (3.0 is usual) or None to turn it off")

    log_ratio = zero_unmasked(logprobs - old_logprobs.detach(), m).clamp(-20.0, 20.0)
    adv = zero_unmasked(advantages.detach(), m)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(m)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_active = (adv < 0) & (loss_mat > cap)
        loss_mat = torch.where(dual_active, cap, loss_mat)
    if is_weights is not None:
        as_bool_mask(mask, is_weights, "is_weights")
        loss_mat = loss_mat * zero_unmasked(is_weights.detach(), m)
    loss = aggregate(loss_mat, m, agg, normalizer)

    with torch.no_grad():
        floats = ratio.dtype
        return PolicyLossOutput(
            loss=loss,
            clip_fraction=masked_mean((clipped > unclipped).to(floats), m),
            approx_kl=masked_mean(ratio - 1.0 - log_ratio, m),
            ratio_mean=masked_mean(ratio, m),
            dual_clip_fraction=masked_mean(dual_active.to(floats), m),
        )


def kl_penalty(
    logprobs: Tensor,  # [B, T]
    ref_logprobs: Tensor,  # [B, T]
    kind: str = "low_var_kl",
) -> Tensor:  # [B, T]
    """Per-token KL(pi || pi_ref) estimate; mask and aggregate it yourself (e.g. with `aggregate`)."""
    canonical = KL_KINDS.get(kind)
    if canonical is None:
        raise ValueError(f"KL kind {kind!r} is not known; use one of {', '.join(KL_KINDS)}")
    log_ratio = logprobs - ref_logprobs
    if canonical == "k1":
        return log_ratio
    if canonical == "k2":
        return 0.5 * log_ratio**2
    ref_minus = (-log_ratio).clamp(-20.0, 20.0)
    return (torch.exp(ref_minus) - ref_minus - 1.0).clamp(-10.0, 10.0)


def truncated_is_weights(
    trainer_logprobs: Tensor,  # [B, T] trainer's logprobs of the sampled tokens (old policy)
    engine_logprobs: Tensor,  # [B, T] the rollout engine's logprobs of the same tokens
    mask: Tensor,  # [B, T]
    cap: float = 2.0,
) -> Tensor:  # [B, T] detached, 1 on unmasked positions
    """min(pi_trainer / pi_engine, cap) per policy token."""
    m = as_bool_mask(mask, trainer_logprobs, "trainer_logprobs")
    as_bool_mask(mask, engine_logprobs, "engine_logprobs")
    if cap <= 0:
        raise ValueError(f"cap={cap} must be > 0 (2.0 is usual)")
    with torch.no_grad():
        log_w = zero_unmasked(trainer_logprobs - engine_logprobs, m).clamp(max=math.log(cap))
        return torch.where(m, torch.exp(log_w), torch.ones((), dtype=log_w.dtype, device=log_w.device))


def value_loss(
    values: Tensor,  # [B, T] current critic, differentiable
    old_values: Tensor,  # [B, T] critic at rollout time
    returns: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    clip: float = 0.2,
    agg: AggMode = "token-mean",
    normalizer: float | int | Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # (loss [], clip_fraction [])
    """PPO clipped value loss (to minimise) and the share of policy tokens where clipping won."""
    m = as_bool_mask(mask, values, "values")
    as_bool_mask(mask, old_values, "old_values")
    as_bool_mask(mask, returns, "returns")
    if clip < 0:
        raise ValueError(f"clip={clip} must be >= 0")
    v = zero_unmasked(values, m)
    old = zero_unmasked(old_values.detach(), m)
    target = zero_unmasked(returns.detach(), m)
    v_clipped = old + (v - old).clamp(-clip, clip)
    err = (v - target) ** 2
    err_clipped = (v_clipped - target) ** 2
    loss = aggregate(0.5 * torch.maximum(err, err_clipped), m, agg, normalizer)
    with torch.no_grad():
        clip_fraction = masked_mean((err_clipped > err).to(err.dtype), m)
    return loss, clip_fraction


def _check_chunk(chunk_size: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1 (a number of tokens along T)")


def entropy_from_logits(logits: Tensor, chunk_size: int = 1024) -> Tensor:  # [B, T, V] -> [B, T] float32
    """Entropy of softmax(logits) per token: logsumexp(z) - sum softmax(z) * z, chunked over T."""
    _check_chunk(chunk_size)
    parts = []
    for start in range(0, logits.shape[1], chunk_size):
        z = logits[:, start : start + chunk_size].float()
        # Entropy is shift-invariant; centring on the max keeps lse and sum(p * z) small, so their
        # difference does not cancel catastrophically in float32 when logits are large.
        z = z - z.amax(dim=-1, keepdim=True).detach()
        lse = torch.logsumexp(z, dim=-1)
        parts.append(lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1))
    return torch.cat(parts, dim=1) if parts else logits.new_zeros(logits.shape[:2], dtype=torch.float32)


def logprobs_from_logits(
    logits: Tensor,  # [B, T, V]
    labels: Tensor,  # [B, T] long, the token whose logprob is wanted at each position
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> Tensor:  # [B, T] float32
    """log softmax(logits / temperature) at `labels`, without materialising the log-softmax."""
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels have shape {tuple(labels.shape)}; logits {tuple(logits.shape)} need [B, T]")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (use the sampling temperature)")
    _check_chunk(chunk_size)
    parts = []
    for start in range(0, logits.shape[1], chunk_size):
        z = logits[:, start : start + chunk_size].float()
        if temperature != 1.0:
            z = z / temperature
        picked = z.gather(-1, labels[:, start : start + chunk_size, None].long()).squeeze(-1)
        parts.append(picked - torch.logsumexp(z, dim=-1))
    return torch.cat(parts, dim=1) if parts else logits.new_zeros(logits.shape[:2], dtype=torch.float32)
