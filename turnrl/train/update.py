"""One RL update on a rollout batch: logprob passes, advantages, and the optimizer steps.

Only policy tokens count anywhere: the loss mask gates the policy loss, the KL term, the entropy bonus and
GAE. Gradient accumulation over token-budget micro-batches uses the mini-batch's global token (or sequence)
count as the normalizer, so the update equals one big batch whatever the micro-batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from turnrl.algo import advantages as adv
from turnrl.algo.losses import aggregate, kl_penalty, ppo_policy_loss, truncated_is_weights, value_loss
from turnrl.algo.masked import masked_mean
from turnrl.ledger import Batch
from turnrl.train.batching import Rows, micro_batches, mini_batches
from turnrl.train.policy import forward_logprobs, forward_values

SEQ_LEVEL = ("grpo", "drgrpo", "rloo")


@dataclass
class UpdateSettings:
    advantage: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    turn_level: bool = False
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    loss_agg: str = "token-mean"
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    value_clip: float = 0.2
    value_coef: float = 0.5
    epochs: int = 1
    mini_batches: int = 1
    micro_batch_tokens: int = 4096
    grad_clip: float = 1.0
    temperature: float = 1.0
    fused_head: bool = False

    @property
    def single_pass(self) -> bool:
        return self.epochs * self.mini_batches == 1

    @property
    def needs_ref(self) -> bool:
        return self.kl_coef > 0


def compute_advantages(s: UpdateSettings, batch: Batch, loss_mask: torch.Tensor, valid_traj: torch.Tensor,
                       traj_rewards: torch.Tensor, traj_groups: torch.Tensor,
                       kl: torch.Tensor | None = None, rows: Rows | None = None) -> torch.Tensor:
    """Advantages [B, T] for the batch rows. Sequence-level estimators work on trajectories (a trajectory
    split into several segments counts once in its group) and skip masked-out trajectories entirely.
    GAE reads `rows.old_values` and stores the value targets in `rows.returns`."""
    rows_traj = batch.traj_index
    if s.advantage in SEQ_LEVEL and not s.turn_level:
        out = torch.zeros_like(traj_rewards)
        idx = valid_traj.nonzero().squeeze(1)
        if len(idx):
            r, g = traj_rewards[idx], traj_groups[idx]
            out[idx] = adv.rloo(r, g) if s.advantage == "rloo" else adv.grpo(r, g, normalize_std=s.advantage == "grpo")
        return adv.broadcast(out[rows_traj], loss_mask)
    token_rewards = batch.token_rewards.to(loss_mask.device)
    if kl is not None and s.kl_in_reward:
        token_rewards = token_rewards - s.kl_coef * kl.detach() * loss_mask
    if s.advantage in SEQ_LEVEL:  # turn-level GRPO / Dr.GRPO
        return adv.grpo_turn_level(token_rewards, batch.turn_ids.to(loss_mask.device), loss_mask,
                                   batch.group_ids.to(loss_mask.device), s.gamma, normalize_std=s.advantage == "grpo")
    if s.advantage in ("reinforce_pp", "reinforce_pp_baseline"):
        baseline = "group_mean" if s.advantage == "reinforce_pp_baseline" else "none"
        return adv.reinforce_pp(token_rewards, loss_mask, s.gamma, batch.group_ids.to(loss_mask.device), baseline)
    if s.advantage == "gae":
        if rows is None or rows.old_values is None:
            raise ValueError("advantage 'gae' needs the critic's values")
        out = adv.gae(token_rewards, rows.old_values, loss_mask, s.gamma, s.lam, whiten=True)
        rows.returns = out.returns
        return out.advantages
    raise ValueError(f"unknown advantage estimator '{s.advantage}'")


def logprob_pass(model: Any, rows: Rows, s: UpdateSettings, amp: torch.dtype | None,
                 values: bool = False) -> torch.Tensor:
    """Logprobs [B, T] of every row under `model` (or its values, for a critic), without gradients,
    micro-batched by tokens."""
    out = torch.zeros_like(rows.old_logprobs)
    all_rows = torch.arange(rows.input_ids.shape[0])
    with torch.no_grad():
        for index, width in micro_batches(all_rows, rows.lengths.cpu(), s.micro_batch_tokens):
            mb = rows.select(index.to(rows.input_ids.device), width)
            if values:
                result = forward_values(model, mb.input_ids, mb.attention_mask, mb.position_ids, amp)
            else:
                result, _ = forward_logprobs(model, mb.input_ids, mb.attention_mask, mb.position_ids,
                                             s.temperature, amp, fused_head=s.fused_head, select=mb.loss_mask > 0)
            out[index.to(out.device), :width] = result.float()
    return out


def policy_update(model: Any, optimizer: torch.optim.Optimizer, scheduler: Any, rows: Rows, s: UpdateSettings,
                  amp: torch.dtype | None, generator: torch.Generator, params: list[torch.nn.Parameter],
                  critic: Any = None) -> dict[str, float]:
    """PPO-style epochs x mini-batches of optimizer steps. With a single pass, the old logprobs are the
    current ones (ratio 1) and the trainer-side logprobs for mismatch metrics come from the same forward."""
    stats: dict[str, list[float]] = {}
    n_rows = rows.input_ids.shape[0]
    seq_mode = s.loss_agg != "token-mean"
    for _ in range(s.epochs):
        for mini in mini_batches(n_rows, s.mini_batches, generator):
            mask = rows.loss_mask[mini.to(rows.loss_mask.device)]
            normalizer = float((mask.sum(1) > 0).sum()) if seq_mode else float(mask.sum())
            if normalizer == 0:
                continue
            optimizer.zero_grad(set_to_none=True)
            for index, width in micro_batches(mini, rows.lengths.cpu(), s.micro_batch_tokens):
                mb = rows.select(index.to(rows.input_ids.device), width)
                micro_step(model, mb, index, rows, s, amp, normalizer, stats, critic)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, s.grad_clip if s.grad_clip > 0 else float("inf"))
            optimizer.step()
            scheduler.step()
            stats.setdefault("grad_norm", []).append(float(grad_norm))
    return {k: sum(v) / len(v) for k, v in stats.items() if v}


def micro_step(model: Any, mb: Rows, index: torch.Tensor, rows: Rows, s: UpdateSettings,
               amp: torch.dtype | None, normalizer: float, stats: dict[str, list[float]], critic: Any = None) -> float:
    """Forward and backward of one micro-batch; returns its loss, its share of the mini-batch objective
    (the shares of all micro-batches, on all ranks, add up to the mini-batch's loss)."""
    logprobs, entropy = forward_logprobs(model, mb.input_ids, mb.attention_mask, mb.position_ids,
                                         s.temperature, amp, with_entropy=True, entropy_grad=s.entropy_coef > 0,
                                         fused_head=s.fused_head, select=mb.loss_mask > 0)
    logprobs = logprobs.float()
    mask = mb.loss_mask
    if s.single_pass:
        old = logprobs.detach()
        rows.old_logprobs[index.to(rows.old_logprobs.device), :mb.input_ids.shape[1]] = old
    else:
        old = mb.old_logprobs
    weights = truncated_is_weights(old, mb.engine_logprobs, mask, s.tis_cap) if s.tis_cap else None
    out = ppo_policy_loss(logprobs, old, mb.advantages, mask, s.clip_low, s.clip_high, s.dual_clip,
                          s.loss_agg, normalizer, weights)
    loss = out.loss
    if s.needs_ref and not s.kl_in_reward:
        kl = kl_penalty(logprobs, mb.ref_logprobs, s.kl_type)
        loss = loss + s.kl_coef * aggregate(kl, mask, s.loss_agg, normalizer)
        _add(stats, "kl/ref", float(masked_mean(kl.detach(), mask)))
    if entropy is not None:
        if s.entropy_coef > 0:
            loss = loss - s.entropy_coef * aggregate(entropy.float(), mask, s.loss_agg, normalizer)
        _add(stats, "entropy", float(masked_mean(entropy.detach().float(), mask)))
    if critic is not None:
        values = forward_values(critic, mb.input_ids, mb.attention_mask, mb.position_ids, amp)
        vloss, vclip = value_loss(values, mb.old_values, mb.returns, mask, s.value_clip, s.loss_agg, normalizer)
        loss = loss + s.value_coef * vloss
        _add(stats, "loss/value", float(vloss.detach()) * _share(mask, normalizer, s.loss_agg))
        _add(stats, "value_clip_fraction", float(vclip))
    loss.backward()
    _add(stats, "loss/policy", float(out.loss.detach()) * _share(mask, normalizer, s.loss_agg))
    _add(stats, "clip_fraction", float(out.clip_fraction))
    _add(stats, "approx_kl/old", float(out.approx_kl))
    if weights is not None:
        _add(stats, "tis/weight_mean", float(masked_mean(weights, mask)))
    return float(loss.detach())


def _share(mask: torch.Tensor, normalizer: float, agg: str) -> float:
    """Undo the micro-batch's share of the normalizer so the logged loss is per token (or sequence)."""
    count = float((mask.sum(1) > 0).sum()) if agg != "token-mean" else float(mask.sum())
    return normalizer / count if count else 0.0


def _add(stats: dict[str, list[float]], key: str, value: float) -> None:
    stats.setdefault(key, []).append(value)
