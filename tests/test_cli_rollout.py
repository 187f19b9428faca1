"""`turnrl rollout CONFIG --out DIR [overrides]`: real rollouts on disk, read back, and a printed summary."""

import json

import pytest

from turnrl.cli import main
from turnrl.ledger import Source
from turnrl.observe.store import read_trajectories

CONFIG = """\
# turnrl rollout THIS --out DIR
model: {name: smollm2-135m-instruct}
data:
  train: {task: feedback_math, size: 3, seed: 0}
rollout:
  n: 3
  max_assistant_turns: 2
  max_response_tokens: 64
  sampling: {temperature: 0.7, max_tokens_per_turn: 16}
reward:
  functions: [last_number]
logging: {progress: "off"}
"""


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "rollout.yaml"
    path.write_text(CONFIG)
    return path


@pytest.mark.slow
def test_rollout_writes_trajectories_and_summary(config, tmp_path, capsys, smollm2_dir, torch_threads):
    out = tmp_path / "run"
    with torch_threads(1):
        code = main(["rollout", str(config), "rollout.n=2", "seed=5", "--out", str(out), "--limit", "2",
                     "--min-reward", "0"])
    assert code == 0
    printed = capsys.readouterr().out
    assert f"rollout summary ({out}/trajectories.jsonl)" in printed
    assert "  trajectories" in printed and "reward_mean" in printed

    records = list(read_trajectories(out / "trajectories.jsonl"))
    trajs = [t for t, _ in records]
    assert [(t.group_id, t.sample_index) for t in trajs] == [
        ("feedback_math-0-0", 0), ("feedback_math-0-0", 1), ("feedback_math-0-1", 0), ("feedback_math-0-1", 1)]
    for traj in trajs:
        traj.check()
        assert traj.parity in ("exact", "token_drift")
        assert traj.termination in ("interaction_done", "max_assistant_turns", "token_budget")
        assert set(traj.reward_parts) >= {"last_number", "interaction"}
        assert traj.reward == pytest.approx(sum(traj.reward_parts[k] for k in ("last_number", "interaction"))
                                            + sum(t.user_reward for t in traj.turns))
        assert traj.n_tokens(Source.POLICY) > 0 and traj.info["data_source"] == "feedback_math"
        assert len(traj.turns) <= 2 and all(t.end - t.start <= 16 for t in traj.turns)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["trajectories"] == 4 and summary["accepted"] == sum(not t.masked for t in trajs)
    assert summary["policy_tokens"] == sum(t.n_tokens(Source.POLICY) for t in trajs)
    assert summary["reward_mean"] == pytest.approx(sum(t.reward for t in trajs) / 4)
    assert sum(v for k, v in summary.items() if k.startswith("termination/")) == 4
    assert len(list(read_trajectories(out / "accepted.jsonl"))) == summary["accepted"]
    saved = (out / "config.yaml").read_text()
    assert "feedback_math" in saved and "seed: 5" in saved


def test_overrides_may_follow_the_options():
    from turnrl.cli import parse_args
    args = parse_args(["rollout", "c.yaml", "--out", "d", "rollout.n=2"])
    assert args.overrides == ["rollout.n=2"] and args.out == "d"


def test_rollout_config_errors_exit_with_a_message(config, tmp_path, capsys):
    assert main(["rollout", str(config), "rollout.nn=2", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "rollout.nn" in err and "rollout.n" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIG.replace("seed: 0}", "seed: 0, options: {colour: red}}"))
    assert main(["rollout", str(bad), "--out", str(tmp_path / "b")]) == 2
    assert "unknown option(s) ['colour']" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_store_round_trip_keeps_extra_fields_and_odd_metric_values(tmp_path):
    import numpy as np
    from fractions import Fraction

    from turnrl.ledger import Trajectory
    from turnrl.observe.store import write_trajectories
    traj = Trajectory(group_id="g", sample_index=1, messages=[{"role": "user", "content": "ü"}],
                      metrics={"np": np.float32(0.5), "arr": np.arange(3), "frac": Fraction(1, 4), "set": {7}})
    path = tmp_path / "t.jsonl"
    write_trajectories(path, [traj], step=3)
    write_trajectories(path, [traj], append=True, split="eval")
    (a, extra_a), (b, extra_b) = list(read_trajectories(path))
    assert extra_a == {"step": 3} and extra_b == {"split": "eval"}
    assert a.metrics == {"np": 0.5, "arr": [0, 1, 2], "frac": 0.25, "set": [7]}
    assert a.messages == traj.messages and a.sample_index == 1 and a.segments[0].token_ids == []
