"""One RL step on a finished, scored batch, the same for every placement of the policy.

    trajectories -> rows (`batch_rows`) -> logprob passes where needed (reference KL; trainer logprobs when
    the update runs several epochs or mini-batches; a critic's values) -> advantages (`compute_advantages`)
    -> the policy update -> the step's metrics and saved samples

What differs between the local trainer (`turnrl.train.trainer`) and the Ray trainer
(`turnrl.distributed.trainer`) is only where the policy lives, so only that is behind `Placement`: the logprob
passes and the update. Sampling (and dynamic sampling's extra rounds) comes before a step; the weight sync
after it, since the Ray trainer pipelines rollouts against it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from turnrl.ledger import Trajectory
from turnrl.rollout.loop import rollout_seed  # noqa: F401 (the trainers' one seed formula)
from turnrl.train.batching import Rows
from turnrl.train.metrics import batch_rows, save_samples, step_metrics, version_metrics
from turnrl.train.update import UpdateSettings, compute_advantages

Pass = Literal["reference", "policy", "values"]


class Placement(Protocol):
    """Where the policy lives: the two things a step asks of it."""

    async def logprobs(self, rows: Rows, which: Pass) -> torch.Tensor:   # [B, T], no gradients
        ...

    async def update(self, rows: Rows) -> dict[str, float]:   # the optimizer steps; fills rows.old_logprobs
        ...


@dataclass
class StepInputs:
    settings: UpdateSettings
    pad_id: int
    device: torch.device              # where the rows are built
    critic: bool                      # PPO: values from the critic
    reward_names: list[str]
    accuracy_part: str | None
    samples_path: Path
    samples_kept: int


async def run_step(place: Placement, x: StepInputs, trajs: list[Trajectory], step: int,
                   t_rollout: float) -> dict[str, Any]:
    """Train on `trajs` (step `step`, 0-based); the step's metrics (the weight sync is the caller's)."""
    s = x.settings
    t0 = time.perf_counter()
    rows, valid, rewards, groups = batch_rows(trajs, s.turn_level, x.pad_id, x.device)
    if s.needs_ref:
        rows.ref_logprobs = await place.logprobs(rows, "reference")
    if not s.single_pass:
        rows.old_logprobs = await place.logprobs(rows, "policy")
    if x.critic:
        rows.old_values = await place.logprobs(rows, "values")
    kl = rows.engine_logprobs - rows.ref_logprobs if s.kl_in_reward and rows.ref_logprobs is not None else None
    rows.advantages = compute_advantages(s, rows, valid, rewards, groups, kl)
    t_logprob = time.perf_counter() - t0
    t0 = time.perf_counter()
    update = await place.update(rows)
    t_update = time.perf_counter() - t0
    metrics = step_metrics(trajs, rows, t_rollout, x.reward_names, x.accuracy_part)
    metrics.update(version_metrics(trajs, step))
    metrics.update(update)
    metrics.update({"time/rollout_s": t_rollout, "time/logprob_s": t_logprob, "time/update_s": t_update,
                    "throughput/train_tokens_per_s": float(rows.attention_mask.sum()) / max(t_update + t_logprob,
                                                                                             1e-9)})
    save_samples(x.samples_path, trajs, rows, x.samples_kept, step + 1)
    return metrics
