"""DAPO's dynamic sampling and overlong shaping on real trajectory records."""

import asyncio

import pytest

from turnrl.ledger import Source, Trajectory
from turnrl.train.dynamic_sampling import GroupFilter, collect_groups, response_length, shape_overlong


def sampler(rounds: list[dict[str, list[float]]], masked: frozenset = frozenset()):
    """sample(k): the next round's groups {prompt: [reward of each sample]} as scored trajectories."""
    calls = []

    async def sample(k: int) -> list[Trajectory]:
        groups = rounds[len(calls)]
        assert len(groups) == k
        calls.append(k)
        out = []
        for gid, rewards in groups.items():
            for i, r in enumerate(rewards):
                t = Trajectory(group_id=gid, sample_index=i, messages=[], reward=r,
                               reward_parts={"exact": 1.0 if r >= 1 else 0.0})
                if (gid, i) in masked:
                    t.mask("tool crashed")
                out.append(t)
        return out
    return sample, calls


def test_rounds_until_the_batch_holds_enough_groups_with_signal():
    sample, calls = sampler([
        {"a": [1, 1], "b": [0, 1], "c": [0, 0]},      # b kept; a, c dropped
        {"d": [0.5, 0.5], "e": [1, 0], "b": [0, 1]},  # e kept; d dropped; b again (data wrapped): ignored
        {"f": [0, 1], "g": [1, 0], "h": [0, 0]},      # f, g kept (g is surplus), h dropped
    ])
    trajs, m = asyncio.run(collect_groups(sample, 3, GroupFilter(max_rounds=5, prompts_per_round=3, n=2)))
    assert [t.group_id for t in trajs] == ["b", "b", "e", "e", "f", "f"]
    assert m == {"filter_groups/kept": 4.0, "filter_groups/dropped": 4.0, "filter_groups/rounds": 3.0,
                 "filter_groups/filled": 0.0}
    assert calls == [3, 3, 3]


def test_the_cap_tops_the_batch_up_with_dropped_groups():
    sample, _ = sampler([{"a": [1, 1], "b": [0, 1]}, {"c": [0, 0], "d": [1, 1]}])
    trajs, m = asyncio.run(collect_groups(sample, 2, GroupFilter(max_rounds=2, prompts_per_round=2, n=2)))
    assert [t.group_id for t in trajs] == ["b", "b", "a", "a"]
    assert m["filter_groups/rounds"] == 2 and m["filter_groups/filled"] == 1 and m["filter_groups/kept"] == 1


def test_masked_samples_do_not_count_and_metrics_other_than_reward():
    # group a differs only through a masked sample: no signal; group b's rewards differ but its accuracy does not
    sample, _ = sampler([{"a": [1, 1, 0], "b": [0.2, 0.4, 0.6], "c": [1, 0, 0]}], masked=frozenset({("a", 2)}))
    trajs, m = asyncio.run(collect_groups(sample, 3, GroupFilter("accuracy", "exact", 1, 3, n=3)))
    assert m["filter_groups/kept"] == 1 and m["filter_groups/dropped"] == 2
    sample, _ = sampler([{"a": [1, 1, 0], "b": [0.2, 0.4, 0.6], "c": [1, 0, 0]}], masked=frozenset({("a", 2)}))
    _, m = asyncio.run(collect_groups(sample, 3, GroupFilter("reward", "", 1, 3, n=3)))
    assert m["filter_groups/kept"] == 2
    sample, _ = sampler([{"a": [1, 0]}])
    with pytest.raises(ValueError, match="no trajectory has the reward part"):
        asyncio.run(collect_groups(sample, 1, GroupFilter("typo", "", 1, 1, n=2)))


def test_overlong_penalty_on_the_response_tokens():
    def traj(policy: int, tool: int) -> Trajectory:
        t = Trajectory(group_id="a", sample_index=0, messages=[], reward=1.0)
        t.segment.append(list(range(7)), Source.PROMPT, 0)
        t.segment.append([1] * policy, Source.POLICY, 0, [0.0] * policy)
        t.segment.append([2] * tool, Source.TOOL, 0)
        return t
    trajs = [traj(40, 30), traj(80, 5), traj(100, 0)]
    assert [response_length(t) for t in trajs] == [70, 85, 100]
    shape_overlong(trajs, max_len=100, buffer=20, factor=1.0)   # free up to 80 tokens, -1 at 100
    assert [t.reward_parts["overlong"] for t in trajs] == [0.0, -0.25, -1.0]
    assert [t.reward for t in trajs] == [1.0, 0.75, 0.0]
    with pytest.raises(ValueError, match="max_response_tokens"):
        shape_overlong(trajs, max_len=10, buffer=20, factor=1.0)
