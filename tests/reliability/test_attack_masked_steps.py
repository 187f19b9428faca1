"""A step with every trajectory masked is not a zero (issue 17 item 6): no reward is logged for it, a warning
names it, and the run stops after `trainer.max_masked_steps` such steps in a row, with exit status 1."""

import json
from pathlib import Path

from turnrl.cli import main

HERE = Path(__file__).parent


def test_a_run_whose_every_trajectory_is_masked_logs_no_reward_warns_and_stops(tmp_path, capsys):
    rows = [{"uid": f"r{i}", "messages": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "tools": ["no_such_tool"], "ground_truth": str(2 * i)} for i in range(2)]   # every row is broken
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    config = tmp_path / "train.yaml"
    config.write_text("model:\n  name: tiny-random\n")
    code = main(["train", str(config), "engine.dtype=float32", "engine.dtype=float32", "trainer.dtype=float32",
                 f"data.train.path={data}", "data.prompts_per_step=2", "rollout.n=2",
                 "rollout.sampling.max_tokens_per_turn=8", "rollout.max_response_tokens=16",
                 f"reward.functions=[{HERE.parent / 'train' / 'rewards_for_tests.py'}:length_parity]",
                 "trainer.steps=6", "trainer.max_masked_steps=2", "logging.sinks=[]", "logging.progress=off",
                 f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 1                                                  # not a successful run
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]                      # stopped after 2, not 6
    for s in steps:
        assert s["masked"] == s["trajectories"] == 4
        assert not any(k.startswith("reward/") for k in s), s        # never a made-up 0.0
    assert err.count("WARNING: step") == 2 and "all 4 trajectories were masked" in err
    assert "trainer.max_masked_steps" in err and "trainer.resume=latest" in err
