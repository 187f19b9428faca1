"""Every advantage estimator sees the same groups: valid trajectories only, each once (issue 16, item 1).

A masked (environment-failed) trajectory must not be a zero-reward member of its group, and a trajectory
split into several segments must count once, with its turns' returns running across its segments."""

import pytest
import torch

from turnrl.ledger import Segment, Source, Trajectory, Turn
from turnrl.train.batching import to_rows
from turnrl.train.update import UpdateSettings, compute_advantages

ESTIMATORS = [("grpo", False), ("drgrpo", False), ("rloo", False), ("grpo", True), ("drgrpo", True),
              ("reinforce_pp", False), ("reinforce_pp_baseline", False)]


def make(group: str, turn_rewards: list[float], outcome: float, masked: bool = False,
         split: bool = False) -> Trajectory:
    """A trajectory of len(turn_rewards) policy turns separated by user turns; `split` starts a new segment
    (re-rendered history, no policy tokens) before the second turn."""
    t = Trajectory(group_id=group, sample_index=0, messages=[])
    seg = t.segment
    seg.append([1, 2, 3], Source.PROMPT, 0)
    for k, r in enumerate(turn_rewards):
        if k:
            if split and k == 1:
                history = list(seg.token_ids)
                t.segments.append(Segment())
                seg = t.segment
                seg.append(history, Source.TEMPLATE, k)
            seg.append([7, 8], Source.USER, k)
        start = len(seg)
        seg.append([10 + k, 20 + k, 30 + k], Source.POLICY, k, [-0.5, -0.4, -0.3])
        t.turns.append(Turn(k, len(t.segments) - 1, start, len(seg), "stop", "", reward=r))
    t.reward = sum(turn_rewards) + outcome
    if masked:
        t.add_error("tool_error", "the tool crashed")
    t.check()
    return t


def advantages(trajs: list[Trajectory], advantage: str, turn_level: bool) -> list[list[float]]:
    """Per trajectory, the advantages of its policy tokens in order (across its segments)."""
    s = UpdateSettings(advantage=advantage, turn_level=turn_level)
    batch = to_rows(trajs, turn_rewards=turn_level or advantage.startswith("reinforce"))
    keys: dict[str, int] = {}
    groups = torch.tensor([keys.setdefault(t.group_id, len(keys)) for t in trajs])
    valid = torch.tensor([not t.masked for t in trajs])
    rewards = torch.tensor([t.reward for t in trajs])
    adv = compute_advantages(s, batch, valid, rewards, groups)
    out: list[list[float]] = [[] for _ in trajs]
    for row, ti in enumerate(batch.traj_index.tolist()):
        sources = torch.tensor(trajs[ti].segments[len([r for r in batch.traj_index[:row] if r == ti])].sources)
        policy = torch.zeros_like(adv[row], dtype=torch.bool)
        policy[: len(sources)] = sources == Source.POLICY
        out[ti] += adv[row][policy].tolist()
    return out


@pytest.mark.parametrize("advantage,turn_level", ESTIMATORS)
def test_a_masked_member_is_not_a_zero_reward_member(advantage, turn_level):
    # rewards [1, 1, 1, tool crash]: the crash is no evidence; the three equal rewards carry no signal
    trajs = [make("g", [0.0, 0.0], 1.0) for _ in range(3)] + [make("g", [0.0, 0.0], 0.0, masked=True)]
    for traj_adv in advantages(trajs, advantage, turn_level):
        assert traj_adv == pytest.approx([0.0] * len(traj_adv), abs=1e-5), (advantage, turn_level)


@pytest.mark.parametrize("advantage,turn_level", ESTIMATORS)
def test_a_masked_member_changes_nothing(advantage, turn_level):
    base = [make("g", [0.5, 0.0], 1.0), make("g", [0.0, 0.25], 0.0), make("g", [0.0, 0.0], 0.5),
            make("h", [0.0, 0.0], 1.0), make("h", [0.25, 0.0], 0.0)]
    with_masked = base + [make("g", [0.0, 0.0], 0.0, masked=True)]
    expected = advantages(base, advantage, turn_level)
    got = advantages(with_masked, advantage, turn_level)
    for e, g in zip(expected, got):
        assert g == pytest.approx(e, abs=1e-5), (advantage, turn_level)
    assert got[-1] == [0.0] * 6


@pytest.mark.parametrize("advantage,turn_level", ESTIMATORS)
def test_a_split_trajectory_counts_once(advantage, turn_level):
    def group(split: bool) -> list[Trajectory]:
        return [make("g", [0.5, 0.25], 1.0, split=split), make("g", [0.0, 0.0], 0.0),
                make("g", [0.0, 0.5], 0.5), make("h", [0.0, 0.0], 1.0, split=split), make("h", [0.25, 0.0], 0.0)]
    expected = advantages(group(False), advantage, turn_level)
    got = advantages(group(True), advantage, turn_level)
    assert any(abs(x) > 0.01 for row in expected for x in row)
    for e, g in zip(expected, got):
        assert g == pytest.approx(e, abs=1e-5), (advantage, turn_level)
