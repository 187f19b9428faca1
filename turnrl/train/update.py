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
from turnrl.algo.losses import aggregate, kl_penalty, value_loss
from turnrl.algo.masked import masked_mean
from turnrl.algo.policy_losses import policy_loss
from turnrl.algo.rollout_correction import CorrectionSpec, correct
from turnrl.config.schema import AlgoConfig, TrainerConfig
from turnrl.train.batching import Rows, micro_batches, mini_batches, to_device
from turnrl.train.optim import clip_and_step
from turnrl.train.packing import Packed, pack
from turnrl.train.policy import forward_logprobs, forward_values
from turnrl.train.shared_prefix import lane_cost_for, prefix_groups, shared_micro_batches

SEQ_LEVEL = ("grpo", "drgrpo", "rloo")


_ALGO, _TRAINER = AlgoConfig(), TrainerConfig()


@dataclass
class UpdateSettings:
    """What the update needs from `algo.*` and `trainer.*` (built by keyword in `settings_from`); each default
    is the config's, so a setting has one default wherever it is read."""
    advantage: str = _ALGO.advantage
    gamma: float = _ALGO.gamma
    lam: float = _ALGO.lam
    turn_level: bool = _ALGO.turn_level
    clip_low: float = _ALGO.clip_low
    clip_high: float = _ALGO.clip_high
    dual_clip: float | None = _ALGO.dual_clip
    loss_agg: str = _ALGO.loss_agg
    kl_coef: float = _ALGO.kl_coef
    kl_type: str = _ALGO.kl_type
    kl_in_reward: bool = _ALGO.kl_in_reward
    entropy_coef: float = _ALGO.entropy_coef
    tis_cap: float | None = _ALGO.tis_cap
    value_clip: float = _ALGO.value_clip
    value_coef: float = _ALGO.value_coef
    epochs: int = _TRAINER.epochs_per_step
    mini_batches: int = _TRAINER.mini_batches
    micro_batch_tokens: int = _TRAINER.micro_batch_tokens
    grad_clip: float = _TRAINER.optim.grad_clip
    temperature: float = 1.0
    fused_head: bool = False
    packing: bool = False        # the model must be under `turnrl.train.packing.use_packed_attention`
    shared_prefix: bool = False  # run each group's shared prompt once per micro-batch (turnrl.train.shared_prefix)
    loss_mode: str = _ALGO.loss_mode   # turnrl.algo.policy_losses.POLICY_LOSSES
    correction: CorrectionSpec | None = None   # rollout correction (tis_cap alone: token-level IS at that cap)
    exact: torch.dtype | None = None  # engine.exact: the batch-invariant forward in the engine's dtype (turnrl.exact)

    @property
    def single_pass(self) -> bool:
        return self.epochs * self.mini_batches == 1

    @property
    def needs_ref(self) -> bool:
        return self.kl_coef > 0

    @property
    def correction_spec(self) -> CorrectionSpec | None:
        if self.correction is not None and self.correction.active:
            return self.correction
        return CorrectionSpec(is_level="token", is_cap=self.tis_cap) if self.tis_cap else None


def compute_advantages(s: UpdateSettings, rows: Rows, valid_traj: torch.Tensor, traj_rewards: torch.Tensor,
                       traj_groups: torch.Tensor, kl: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages [B, T] for the batch rows. Every estimator sees the same groups: the valid trajectories,
    each once. Sequence-level estimators work on the trajectory rewards; token-level ones on each valid
    trajectory's segments laid end to end (`by_trajectory`), so a split trajectory's returns run across its
    segments and its group counts it once; masked trajectories get 0 and are no member of any group.
    GAE reads `rows.old_values` and stores the value targets in `rows.returns`."""
    loss_mask = rows.loss_mask
    rows_traj = rows.traj_index.to(loss_mask.device)
    idx = valid_traj.nonzero().squeeze(1)
    if s.advantage in SEQ_LEVEL and not s.turn_level:
        out = torch.zeros_like(traj_rewards)
        if len(idx):
            r, g = traj_rewards[idx], traj_groups[idx]
            out[idx] = adv.rloo(r, g) if s.advantage == "rloo" else adv.grpo(r, g, normalize_std=s.advantage == "grpo")
        return adv.broadcast(out[rows_traj], loss_mask)
    if s.advantage not in SEQ_LEVEL + ("reinforce_pp", "reinforce_pp_baseline", "gae"):
        raise ValueError(f"unknown advantage estimator '{s.advantage}'")
    if s.advantage == "gae" and rows.old_values is None:
        raise ValueError("advantage 'gae' needs the critic's values")
    token_rewards = rows.token_rewards.to(loss_mask.device)
    if kl is not None and s.kl_in_reward:
        token_rewards = token_rewards - s.kl_coef * kl.detach() * loss_mask
    lay = Layout(rows_traj, len(traj_rewards), idx)
    mask, rewards, groups = lay.gather(loss_mask), lay.gather(token_rewards), traj_groups[idx]
    if s.advantage in SEQ_LEVEL:  # turn-level GRPO / Dr.GRPO
        turns = lay.gather(rows.turn_ids.to(loss_mask.device))
        return lay.scatter(adv.grpo_turn_level(rewards, turns, mask, groups, s.gamma,
                                               normalize_std=s.advantage == "grpo"))
    if s.advantage in ("reinforce_pp", "reinforce_pp_baseline"):
        baseline = "group_mean" if s.advantage == "reinforce_pp_baseline" else "none"
        return lay.scatter(adv.reinforce_pp(rewards, mask, s.gamma, groups, baseline))
    out = adv.gae(rewards, lay.gather(rows.old_values), mask, s.gamma, s.lam, whiten=True)
    rows.returns = lay.scatter(out.returns)
    return lay.scatter(out.advantages)


class Layout:
    """The valid trajectories' rows laid end to end: row tensors [B, T] <-> trajectory tensors [V, R * T],
    R the most segments of one trajectory, V the valid trajectories (`valid`, indices into the N
    trajectories). Rows come in trajectory order (as `to_rows` writes them); a trajectory's k-th row fills
    columns [k * T, (k + 1) * T). Padding and non-policy positions stay masked, so the estimators' walks over
    the policy tokens see one trajectory's tokens in order."""

    def __init__(self, traj_index: torch.Tensor, n_traj: int, valid: torch.Tensor):
        counts = torch.bincount(traj_index, minlength=n_traj)
        first = torch.cumsum(counts, 0) - counts
        self.slot = torch.arange(len(traj_index), device=traj_index.device) - first[traj_index]   # [B]
        self.width = int(counts.max()) if len(counts) else 1
        slot_of = torch.full((n_traj,), -1, dtype=torch.long, device=traj_index.device)
        slot_of[valid] = torch.arange(len(valid), device=traj_index.device)
        self.target = slot_of[traj_index]                                                         # [B], -1: masked
        self.n_valid = len(valid)

    def gather(self, x: torch.Tensor) -> torch.Tensor:   # [B, T] -> [V, R * T]
        B, T = x.shape
        out = x.new_zeros(self.n_valid, self.width, T)
        keep = self.target >= 0
        out[self.target[keep], self.slot[keep]] = x[keep]
        return out.reshape(self.n_valid, self.width * T)

    def scatter(self, y: torch.Tensor) -> torch.Tensor:  # [V, R * T] -> [B, T], 0 on masked trajectories
        T = y.shape[1] // self.width
        y = y.reshape(self.n_valid, self.width, T)
        out = y.new_zeros(len(self.target), T)
        keep = self.target >= 0
        out[keep] = y[self.target[keep], self.slot[keep]]
        return out


def logprob_pass(model: Any, rows: Rows, s: UpdateSettings, amp: torch.dtype | None,
                 values: bool = False) -> torch.Tensor:
    """Logprobs [B, T] of every row under `model` (or its values, for a critic), without gradients,
    micro-batched by tokens."""
    out = torch.zeros_like(rows.old_logprobs)
    all_rows = torch.arange(rows.input_ids.shape[0])
    counts = rows.host()
    lengths = counts.lengths
    packing = s.packing and not values   # a critic keeps its own (padded) attention
    sharing = Sharing(rows, s, enabled=not values)
    with torch.no_grad():
        for index, width in sharing.micro_batches(all_rows, lengths, packing):
            packed = pack(lengths[index], rows.input_ids.device) if packing else None
            shared = sharing.of(index)
            selected = counts.selected_in(index)
            index = to_device(index, rows.input_ids.device)
            mb = rows.select(index, width)
            if values:
                result = forward_values(model, mb.input_ids, mb.attention_mask, mb.position_ids, amp)
            else:
                result, _ = forward_logprobs(model, mb.input_ids, mb.attention_mask, mb.position_ids,
                                             s.temperature, amp, fused_head=s.fused_head, select=mb.loss_mask > 0,
                                             packed=packed, shared=shared, exact=s.exact, selected=selected)
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
    counts = rows.host()   # no device sync when the rows came to the device through `Rows.to`
    lengths = counts.lengths
    for _ in range(s.epochs):
        for mini in mini_batches(n_rows, s.mini_batches, generator):
            normalizer = counts.normalizer(mini, seq_mode)
            if normalizer == 0:
                continue
            optimizer.zero_grad(set_to_none=True)
            for index, width in sharing.micro_batches(mini, lengths, s.packing):
                packed = pack(lengths[index], rows.input_ids.device) if s.packing else None
                shared = sharing.of(index)
                selected = counts.selected_in(index)
                index = to_device(index, rows.input_ids.device)
                micro_step(model, rows.select(index, width), index, rows, s, amp, normalizer, stats, critic, packed,
                           shared, selected)
            grad_norm = clip_and_step(optimizer, params, s.grad_clip)
            scheduler.step()
            # freed now, while the device works through the queued step (the next update's start then finds
            # nothing to clear, and the gradients do not sit in memory through the next rollout)
            optimizer.zero_grad(set_to_none=True)
            _add(stats, "grad_norm", grad_norm)
    return means(stats)


def micro_step(model: Any, mb: Rows, index: torch.Tensor, rows: Rows, s: UpdateSettings,
               amp: torch.dtype | None, normalizer: float, stats: Stats, critic: Any = None,
               packed: Packed | None = None, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
               selected: int | None = None) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns its loss [] (detached, on the device), its share of
    the mini-batch objective (the shares of all micro-batches, on all ranks, add up to the mini-batch's loss).
    `packed`: the packing of the micro-batch's rows (with `s.packing`); `shared`: its rows' (group, prefix)
    (with `s.shared_prefix`); `selected`: its policy tokens after column 0, from the host's counts (spares the
    fused head a sync). Metrics go to `stats` as device tensors (`means` reads them)."""
    logprobs, entropy = forward_logprobs(model, mb.input_ids, mb.attention_mask, mb.position_ids,
                                         s.temperature, amp, with_entropy=True, entropy_grad=s.entropy_coef > 0,
                                         fused_head=s.fused_head, select=mb.loss_mask > 0, packed=packed,
                                         shared=shared, exact=s.exact, selected=selected)
    logprobs = logprobs.float()
    mask = mb.loss_mask
    if s.single_pass:
        old = logprobs.detach()
        rows.old_logprobs[index.to(rows.old_logprobs.device), :mb.input_ids.shape[1]] = old
    else:
        old = mb.old_logprobs
    spec = s.correction_spec
    corrected = correct(old, mb.engine_logprobs, mask, spec) if spec is not None else None
    weights = corrected.weights if corrected is not None else None
    full_mask, mask = mask, (corrected.keep if corrected is not None else mask)   # rejected tokens leave the loss
    out = policy_loss(s.loss_mode, logprobs, old, mb.advantages, mask, s.clip_low, s.clip_high, s.dual_clip,
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
        vloss, vclip = value_loss(values, mb.old_values, mb.returns, full_mask, s.value_clip, s.loss_agg, normalizer)
        loss = loss + s.value_coef * vloss
        _add(stats, "loss/value", vloss * _share(full_mask, normalizer, s.loss_agg))
        _add(stats, "value_clip_fraction", vclip)
    loss.backward()
    _add(stats, "loss/policy", out.loss * _share(full_mask, normalizer, s.loss_agg))
    _add(stats, "clip_fraction", out.clip_fraction)
    _add(stats, "approx_kl/old", out.approx_kl)
    if corrected is not None:
        for key, value in corrected.metrics._asdict().items():
            _add(stats, f"correction/{key}", value)
    return loss.detach()


Stats = dict[str, list[torch.Tensor]]   # metric -> one [] tensor per micro-batch (or optimizer step)


class Sharing:
    """The rows' shared-prefix groups (once per update) and the micro-batches that keep groups together."""

    def __init__(self, rows: Rows, s: UpdateSettings, enabled: bool = True):
        self.budget = s.micro_batch_tokens
        self.lane_cost = lane_cost_for(rows.input_ids.device.type)
        self.group = self.prefix = None
        if enabled and s.shared_prefix and not s.packing:
            self.group, self.prefix = prefix_groups(rows.input_ids, rows.attention_mask, rows.position_ids,
                                                    rows.loss_mask)
            if not bool((self.group >= 0).any()):
                self.group = self.prefix = None

    def micro_batches(self, index: torch.Tensor, lengths: torch.Tensor, packing: bool) -> list[tuple[torch.Tensor, int]]:
        if self.group is None:
            return micro_batches(index, lengths, self.budget, packing)
        return shared_micro_batches(index, lengths, self.group, self.prefix, self.budget, self.lane_cost)

    def of(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.group is None else (self.group[index], self.prefix[index])


def means(stats: Stats) -> dict[str, float]:
    """Each metric's mean over its entries, read from the device once, after the work is queued."""
    keys = [k for k, v in stats.items() if v]
    if not keys:
        return {}
    device = stats[keys[0]][0].device
    values = torch.stack([torch.stack([x.float().reshape(()).to(device) for x in stats[k]]).mean() for k in keys])
    return dict(zip(keys, values.cpu().tolist()))   # one copy from the device


def _share(mask: torch.Tensor, normalizer: float, agg: str) -> torch.Tensor:
    """Undo the micro-batch's share of the normalizer so the logged loss is per token (or sequence)."""
    count = (mask.sum(1) > 0).sum() if agg != "token-mean" else mask.sum()
    return torch.where(count > 0, normalizer / count.clamp(min=1), 0.0)


def _add(stats: Stats, key: str, value: torch.Tensor) -> None:
    stats.setdefault(key, []).append(value.detach())
