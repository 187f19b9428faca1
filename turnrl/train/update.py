"""One RL update on a rollout batch: logprob passes, advantages, and the optimizer steps.

Only policy tokens count anywhere: the loss mask gates the policy loss, the KL term, the entropy bonus and
GAE. Gradient accumulation over token-budget micro-batches uses the mini-batch's global token (or sequence)
count as the normalizer, so the update equals one big batch whatever the micro-batch size. With `packing`
(`turnrl.train.packing`) each micro-batch runs as one packed row without padding; the loss sees the same
[B, T] tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from turnrl.algo import advantages as adv
from turnrl.algo.losses import aggregate, kl_penalty, ppo_policy_loss, truncated_is_weights, value_loss
from turnrl.algo.masked import masked_mean
from turnrl.ledger import Batch
from turnrl.train.batching import Rows, micro_batches, mini_batches, to_device
from turnrl.train.packing import Packed, pack
from turnrl.train.policy import forward_logprobs, forward_values
from turnrl.train.shared_prefix import prefix_groups, shared_micro_batches

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
    packing: bool = False        # the model must be under `turnrl.train.packing.use_packed_attention`
    shared_prefix: bool = False  # run each group's shared prompt once per micro-batch (turnrl.train.shared_prefix)

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
    lengths = rows.lengths.cpu()
    packing = s.packing and not values   # a critic keeps its own (padded) attention
    sharing = Sharing(rows, s, enabled=not values)
    with torch.no_grad():
        for index, width in sharing.micro_batches(all_rows, lengths, packing):
            packed = pack(lengths[index], rows.input_ids.device) if packing else None
            shared = sharing.of(index)
            index = to_device(index, rows.input_ids.device)
            mb = rows.select(index, width)
            if values:
                result = forward_values(model, mb.input_ids, mb.attention_mask, mb.position_ids, amp)
            else:
                result, _ = forward_logprobs(model, mb.input_ids, mb.attention_mask, mb.position_ids,
                                             s.temperature, amp, fused_head=s.fused_head, select=mb.loss_mask > 0,
                                             packed=packed, shared=shared)
            out[index.to(out.device), :width] = result.float()
    return out


def policy_update(model: Any, optimizer: torch.optim.Optimizer, scheduler: Any, rows: Rows, s: UpdateSettings,
                  amp: torch.dtype | None, generator: torch.Generator, params: list[torch.nn.Parameter],
                  critic: Any = None) -> dict[str, float]:
    """PPO-style epochs x mini-batches of optimizer steps. With a single pass, the old logprobs are the
    current ones (ratio 1) and the trainer-side logprobs for mismatch metrics come from the same forward.
    Metrics stay on the device until the end: nothing in the micro-batch loop waits for the GPU."""
    stats: Stats = {}
    n_rows = rows.input_ids.shape[0]
    seq_mode = s.loss_agg != "token-mean"
    sharing = Sharing(rows, s, enabled=critic is None)
    for _ in range(s.epochs):
        for mini in mini_batches(n_rows, s.mini_batches, generator):
            mask = rows.loss_mask[mini.to(rows.loss_mask.device)]
            normalizer = float((mask.sum(1) > 0).sum()) if seq_mode else float(mask.sum())
            if normalizer == 0:
                continue
            optimizer.zero_grad(set_to_none=True)
            lengths = rows.lengths.cpu()
            for index, width in sharing.micro_batches(mini, lengths, s.packing):
                packed = pack(lengths[index], rows.input_ids.device) if s.packing else None
                shared = sharing.of(index)
                index = to_device(index, rows.input_ids.device)
                micro_step(model, rows.select(index, width), index, rows, s, amp, normalizer, stats, critic, packed,
                           shared)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, s.grad_clip if s.grad_clip > 0 else float("inf"))
            optimizer.step()
            scheduler.step()
            _add(stats, "grad_norm", grad_norm)
    return means(stats)


def micro_step(model: Any, mb: Rows, index: torch.Tensor, rows: Rows, s: UpdateSettings,
               amp: torch.dtype | None, normalizer: float, stats: Stats, critic: Any = None,
               packed: Packed | None = None, shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns its loss [] (detached, on the device), its share of
    the mini-batch objective (the shares of all micro-batches, on all ranks, add up to the mini-batch's loss).
    `packed`: the packing of the micro-batch's rows (with `s.packing`); `shared`: its rows' (group, prefix)
    (with `s.shared_prefix`). Metrics go to `stats` as device tensors (`means` reads them)."""
    logprobs, entropy = forward_logprobs(model, mb.input_ids, mb.attention_mask, mb.position_ids,
                                         s.temperature, amp, with_entropy=True, entropy_grad=s.entropy_coef > 0,
                                         fused_head=s.fused_head, select=mb.loss_mask > 0, packed=packed,
                                         shared=shared)
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
        _add(stats, "kl/ref", masked_mean(kl.detach(), mask))
    if entropy is not None:
        if s.entropy_coef > 0:
            loss = loss - s.entropy_coef * aggregate(entropy.float(), mask, s.loss_agg, normalizer)
        _add(stats, "entropy", masked_mean(entropy.detach().float(), mask))
    if critic is not None:
        values = forward_values(critic, mb.input_ids, mb.attention_mask, mb.position_ids, amp)
        vloss, vclip = value_loss(values, mb.old_values, mb.returns, mask, s.value_clip, s.loss_agg, normalizer)
        loss = loss + s.value_coef * vloss
        _add(stats, "loss/value", vloss * _share(mask, normalizer, s.loss_agg))
        _add(stats, "value_clip_fraction", vclip)
    loss.backward()
    _add(stats, "loss/policy", out.loss * _share(mask, normalizer, s.loss_agg))
    _add(stats, "clip_fraction", out.clip_fraction)
    _add(stats, "approx_kl/old", out.approx_kl)
    if weights is not None:
        _add(stats, "tis/weight_mean", masked_mean(weights, mask))
    return loss.detach()


Stats = dict[str, list[torch.Tensor]]   # metric -> one [] tensor per micro-batch (or optimizer step)


class Sharing:
    """The rows' shared-prefix groups (once per update) and the micro-batches that keep groups together."""

    def __init__(self, rows: Rows, s: UpdateSettings, enabled: bool = True):
        self.budget = s.micro_batch_tokens
        self.group = self.prefix = None
        if enabled and s.shared_prefix and not s.packing:
            self.group, self.prefix = prefix_groups(rows.input_ids, rows.attention_mask, rows.position_ids,
                                                    rows.loss_mask)
            if not bool((self.group >= 0).any()):
                self.group = self.prefix = None

    def micro_batches(self, index: torch.Tensor, lengths: torch.Tensor, packing: bool) -> list[tuple[torch.Tensor, int]]:
        if self.group is None:
            return micro_batches(index, lengths, self.budget, packing)
        return shared_micro_batches(index, lengths, self.group, self.prefix, self.budget)

    def of(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.group is None else (self.group[index], self.prefix[index])


def means(stats: Stats) -> dict[str, float]:
    """Each metric's mean over its entries, read from the device once, after the work is queued."""
    return {k: float(torch.stack([x.float().cpu() for x in v]).mean()) for k, v in stats.items() if v}


def _share(mask: torch.Tensor, normalizer: float, agg: str) -> torch.Tensor:
    """Undo the micro-batch's share of the normalizer so the logged loss is per token (or sequence)."""
    count = (mask.sum(1) > 0).sum() if agg != "token-mean" else mask.sum()
    return torch.where(count > 0, normalizer / count.clamp(min=1), 0.0)


def _add(stats: Stats, key: str, value: torch.Tensor) -> None:
    stats.setdefault(key, []).append(value.detach())
