"""DAPO's data side in the RL loop: overlong reward shaping and dynamic sampling (Yu et al. 2025,
arXiv:2503.14476; the maths is in `turnrl.algo.dapo`).

- `shape_overlong` adds DAPO's soft overlong penalty to each scored trajectory (reward part `overlong`). The
  response length is every token after the first prompt, the policy's and the environment's (tool results, user
  replies, template glue): the count `rollout.max_response_tokens` limits, and what verl's DAPO reward manager
  reads in multi-turn (the whole response part). A trajectory split into segments by a template mismatch counts
  each segment's tokens after its prompt.
- `collect_groups` is dynamic sampling: roll out `prompts_per_round` prompts (each `rollout.n` times), keep the
  groups whose filter metric varies, and roll out more prompts until `need` groups are kept or `max_rounds`
  rounds ran (0: no limit), as verl's `algorithm.filter_groups` with `data.gen_batch_size`. The metric is
  `reward` (the trajectory's total reward, verl's `score` / `seq_reward`), `accuracy` (the accuracy part >= 1,
  verl's `acc`) or any reward part. Trajectories masked out by environment failures do not count; a group needs
  two or more scored samples that differ (one, when `rollout.n` is 1). A prompt seen twice in one step (a small
  data set wrapping) is kept once. Deviation from verl: when the cap is reached with too few groups, verl stops
  the run with an error; turnrl trains on a full batch anyway, topping it up with dropped groups (their
  advantage is 0 under the group estimators) and logs how many (`filter_groups/filled`), so a run on easy data
  does not die at step 300.
Metrics: `filter_groups/kept` and `filter_groups/dropped` (groups, over all rounds of the step),
`filter_groups/rounds`, `filter_groups/filled`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

import torch

from turnrl.algo.dapo import groups_with_signal, overlong_penalty
from turnrl.config import Config
from turnrl.ledger import Source, Trajectory

__all__ = ["GroupFilter", "collect_groups", "collect_step", "response_length", "shape_overlong"]


def response_length(traj: Trajectory) -> int:
    """Tokens after the prompt, in every segment."""
    return sum(len(seg) - seg.count(Source.PROMPT) for seg in traj.segments)


def shape_overlong(trajs: list[Trajectory], max_len: int, buffer: int, factor: float) -> None:
    """Add DAPO's overlong penalty to each trajectory's reward (part `overlong`); buffer 0 does nothing."""
    if buffer <= 0 or not trajs:
        return
    if buffer > max_len:
        raise ValueError(f"reward.overlong.buffer={buffer} is longer than rollout.max_response_tokens={max_len}: "
                         "the buffer is the last tokens before the limit; make it smaller")
    penalties = overlong_penalty(torch.tensor([response_length(t) for t in trajs]), max_len, buffer, factor)
    for traj, p in zip(trajs, penalties.tolist()):
        traj.reward_parts["overlong"] = p
        traj.reward += p


@dataclass(frozen=True)
class GroupFilter:
    metric: str = "reward"       # reward | accuracy | a reward part
    accuracy_part: str = ""      # the reward part `accuracy` reads (>= 1 counts as correct)
    max_rounds: int = 4          # 0: no limit
    prompts_per_round: int = 1
    n: int = 1                   # samples per prompt

    def value(self, traj: Trajectory) -> float | None:
        if self.metric == "reward":
            return traj.reward
        part = self.accuracy_part if self.metric == "accuracy" else self.metric
        value = traj.reward_parts.get(part)
        if value is None:
            return None
        return float(value >= 1.0) if self.metric == "accuracy" else float(value)


def _groups(trajs: list[Trajectory]) -> dict[str, list[Trajectory]]:
    out: dict[str, list[Trajectory]] = {}
    for t in trajs:
        out.setdefault(t.group_id, []).append(t)
    return out


def _with_signal(groups: dict[str, list[Trajectory]], f: GroupFilter) -> dict[str, bool]:
    scored = [(gid, v) for gid, members in groups.items() for t in members if not t.masked
              for v in [f.value(t)] if v is not None]
    ids = {gid: k for k, gid in enumerate(groups)}
    keep = groups_with_signal(torch.tensor([v for _, v in scored], dtype=torch.float64),
                              torch.tensor([ids[g] for g, _ in scored], dtype=torch.long)).tolist()
    count = {gid: 0 for gid in groups}
    signal = {gid: False for gid in groups}
    for (gid, _), k in zip(scored, keep):
        count[gid] += 1
        signal[gid] = signal[gid] or k
    return {gid: signal[gid] and (count[gid] >= 2 or f.n == 1) for gid in groups}


async def collect_groups(sample: Callable[[int], Awaitable[list[Trajectory]]], need: int,
                         f: GroupFilter) -> tuple[list[Trajectory], dict[str, float]]:
    """Scored trajectories of `need` groups with signal (see the module docstring), and the step's metrics.
    `sample(k)` rolls out and scores the next k prompts."""
    if not f.metric:
        raise ValueError("algo.filter_groups.metric is empty: use reward, accuracy or a reward part's name")
    kept: list[list[Trajectory]] = []
    dropped: list[list[Trajectory]] = []
    seen: set[str] = set()
    rounds = 0
    while len(kept) < need and (f.max_rounds == 0 or rounds < f.max_rounds):
        groups = _groups(await sample(f.prompts_per_round))
        rounds += 1
        fresh = {gid: members for gid, members in groups.items() if gid not in seen}
        seen.update(fresh)
        for gid, ok in _with_signal(fresh, f).items():
            (kept if ok else dropped).append(fresh[gid])
        part = f.accuracy_part if f.metric == "accuracy" else f.metric
        if f.metric != "reward" and fresh and not any(
                part in t.reward_parts for members in fresh.values() for t in members):
            raise ValueError(f"algo.filter_groups.metric={f.metric!r}: no trajectory has the reward part {part!r}; "
                             "use reward, or a part the rewards write (reward.accuracy_part for accuracy; see the "
                             "reward/<part> metrics)")
    found = len(kept)
    filled = max(0, need - found)
    chosen = kept[:need] + dropped[:filled]
    metrics = {"filter_groups/kept": float(found), "filter_groups/dropped": float(len(dropped)),
               "filter_groups/rounds": float(rounds), "filter_groups/filled": float(min(filled, len(dropped)))}
    return [t for group in chosen for t in group], metrics


async def collect_step(sample: Callable[[int], Awaitable[list[Trajectory]]], cfg: Config,
                       reward_names: list[str]) -> tuple[list[Trajectory], dict[str, float]]:
    """One step's scored trajectories: `data.prompts_per_step` prompts, or, with `algo.filter_groups.enable`,
    that many groups with signal (`collect_groups`)."""
    fg = cfg.algo.filter_groups
    need = cfg.data.prompts_per_step
    if not fg.enable:
        return await sample(need), {}
    accuracy = cfg.reward.accuracy_part or (reward_names[0] if reward_names else "interaction")
    f = GroupFilter(fg.metric, accuracy, fg.max_rounds, fg.prompts_per_round or need, cfg.rollout.n)
    return await collect_groups(sample, need, f)
