"""A step's rows and metrics: trajectories -> training rows, and rows + trajectories -> the logged numbers.

`batch_rows` pads the trajectories (`turnrl.train.batching.to_rows`) into `Rows` and gives each trajectory its
validity, reward and integer group id; `step_metrics` reports rewards, turns, error counts, parity and the engine/trainer mismatch
(`turnrl.algo.mismatch`); `save_samples` appends the first trajectories of a step with their advantages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from turnrl.algo.mismatch import mismatch_metrics
from turnrl.ledger import Trajectory
from turnrl.llm import usage_metrics as llm_usage_metrics
from turnrl.observe.store import write_trajectories
from turnrl.rollout.scheduler import summarize
from turnrl.train.batching import Rows, to_rows


def accuracy_of(traj: Trajectory, part: str | None, functions: list[str]) -> float | None:
    key = part or (functions[0] if functions else "interaction")
    value = traj.reward_parts.get(key)
    return None if value is None else float(value >= 1.0)


def batch_rows(trajs: list[Trajectory], turn_level: bool, pad_id: int, device: torch.device
               ) -> tuple[Rows, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, valid [N], rewards [N], groups [N]): the trajectories as training rows on `device` (the engine's
    logprobs as the old ones until a trainer pass replaces them), and per trajectory whether it trains, its
    reward and its prompt group (ids 0, 1, ... in order of first appearance)."""
    rows = to_rows(trajs, turn_rewards=turn_level, pad_id=pad_id).to(device)
    rewards = torch.tensor([t.reward for t in trajs], device=device)
    keys: dict[str, int] = {}
    groups = torch.tensor([keys.setdefault(t.group_id, len(keys)) for t in trajs], device=device)
    valid = torch.tensor([not t.masked for t in trajs], device=device)
    return rows, valid, rewards, groups


def step_metrics(trajs: list[Trajectory], rows: Rows, t_rollout: float, reward_names: list[str],
                 accuracy_part: str | None) -> dict[str, Any]:
    """The step's metrics from its trajectories and training rows (rewards, turns, errors, mismatch)."""
    s = summarize(trajs, t_rollout)
    rewards = [t.reward for t in trajs if not t.masked]   # none scored: no reward at all, never a made-up 0
    acc = [a for a in (accuracy_of(t, accuracy_part, reward_names) for t in trajs if not t.masked) if a is not None]
    m: dict[str, Any] = {} if not rewards else {
        "reward/mean": float(np.mean(rewards)), "reward/std": float(np.std(rewards)),
        "reward/min": float(np.min(rewards)), "reward/max": float(np.max(rewards))}
    m |= {
        "turns/mean": s["turns_mean"], "tool/calls": s["tool_calls"], "tool/errors": s["tool_errors"],
        "masked": s["masked"], "response_tokens/mean": s["response_tokens_mean"],
        "throughput/tokens_per_s": s["policy_tokens_per_s"], "trajectories": len(trajs)}
    if acc:
        m["accuracy"] = float(np.mean(acc))
    for key in s:
        if key.startswith(("termination/", "errors/", "parity/")):
            m[key] = s[key]
    for part in sorted({k for t in trajs for k in t.reward_parts}):
        have = [t.reward_parts[part] for t in trajs if part in t.reward_parts and not t.masked]
        if have:  # the mean over the trajectories that were scored on this part
            m[f"reward/{part}"] = float(np.mean(have))
    for key in sorted({k for t in trajs for k, v in t.metrics.items() if "/" in k and isinstance(v, (int, float))}):
        m[key] = float(np.mean([t.metrics[key] for t in trajs if isinstance(t.metrics.get(key), (int, float))]))
    m.update(llm_usage_metrics())  # judge / simulated-user calls and tokens since the last step
    m.update(mismatch_metrics(rows.old_logprobs, rows.engine_logprobs, rows.loss_mask))
    return m


def version_metrics(trajs: list[Trajectory], step: int) -> dict[str, float]:
    """How old the weights that sampled the trained tokens are, counted per policy token (step - version: the
    trainer is at version `step` when it trains step `step`), and how many turns new weights interrupted."""
    ages = [step - v for t in trajs if not t.masked for turn in t.turns
            for v in turn.token_versions(t.policy_version)]
    if not ages:
        return {}
    return {"staleness/token_mean": float(np.mean(ages)), "staleness/token_max": float(max(ages)),
            "partial/interrupted_turns": float(sum(len(turn.versions) > 1 for t in trajs for turn in t.turns)),
            "partial/interruptions": float(sum(t.metrics.get("interruptions", 0) for t in trajs))}


def save_samples(path: Path, trajs: list[Trajectory], rows: Rows, keep: int, step: int) -> None:
    """Append the first `keep` trajectories of the step, with their advantage and trainer logprobs."""
    if keep <= 0:
        return
    chosen = trajs[:keep]
    for ti, traj in enumerate(chosen):
        row = int((rows.traj_index == ti).nonzero()[-1])
        mask = rows.loss_mask[row] > 0
        traj.metrics["advantage"] = float(rows.advantages[row][mask].mean()) if mask.any() else 0.0
        traj.metrics["trainer_logprobs"] = rows.old_logprobs[row][: len(traj.segment)].tolist()
    write_trajectories(path, chosen, append=True, step=step, split="train")
