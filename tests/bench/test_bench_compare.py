"""`turnrl bench compare`: ratios and directions per figure, config differences, and the CLI on two files."""

import json

import pytest

from turnrl.bench.compare import compare, direction
from turnrl.cli import main


def report(kind, step_s, per_s, lr=1e-5):
    return {"benchmark": kind, "config": {"trainer": {"optim": {"lr": lr}}, "seed": 0},
            "machine": {"loadavg": [1.0, 1.5, 2.0]},
            "summary": {"step_s": {"min": step_s, "median": step_s, "max": step_s},
                        "trajectories_per_s": {"min": per_s, "median": per_s, "max": per_s},
                        "update_mfu_6n": {"min": 0.1, "median": 0.1, "max": 0.1}}}


def test_direction_from_the_name():
    assert direction("step_s") == -1 and direction("rollout_s") == -1
    assert direction("trajectories_per_s") == 1 and direction("update_tflops_6n") == 1
    assert direction("update_mfu_with_attention") == 1 and direction("ratio") == 1
    assert direction("reward_mean") == 0


def test_ratios_and_who_is_better():
    result = compare(report("step", 10.0, 3.2), report("step", 5.0, 6.4, lr=2e-4))
    f = result["figures"]
    assert f["step_s"]["b_over_a"] == pytest.approx(0.5) and f["step_s"]["b_better_by"] == pytest.approx(2.0)
    assert f["trajectories_per_s"]["b_over_a"] == pytest.approx(2.0)
    assert f["trajectories_per_s"]["b_better_by"] == pytest.approx(2.0)
    assert f["update_mfu_6n"]["b_better_by"] == pytest.approx(1.0)
    assert result["config_differences"] == {"trainer.optim.lr": [1e-5, 2e-4]}


def test_reports_of_different_kinds_are_refused():
    with pytest.raises(ValueError, match="cannot compare"):
        compare(report("step", 1, 1), report("train", 1, 1))


def test_compare_cli_on_two_files(tmp_path, capsys):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "cmp.json"
    a.write_text(json.dumps(report("train", 4.0, 1.0)))
    b.write_text(json.dumps(report("train", 2.0, 2.0)))
    assert main(["bench", "compare", str(a), str(b), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "step_s" in text and "B by 2.00x" in text
    saved = json.loads(out.read_text())
    assert saved["of"] == "train" and saved["a"]["summary"]["step_s"]["median"] == 4.0
    assert saved["figures"]["trajectories_per_s"]["b_over_a"] == pytest.approx(2.0)


def test_compare_cli_needs_two_reports(tmp_path):
    with pytest.raises(SystemExit, match="two report files"):
        main(["bench", "compare", str(tmp_path / "only.json")])


TINY = ["model.name=tiny-random", "engine.dtype=float32", "trainer.dtype=float32", "data.train.task=calculator",
        "data.train.size=4", "data.prompts_per_step=1", "rollout.n=2", "rollout.max_response_tokens=24",
        "rollout.sampling.max_tokens_per_turn=8", "reward.functions=[exact_answer]", "logging.sinks=[]",
        "logging.progress=off"]


@pytest.mark.slow
def test_compare_configs_runs_bench_step_on_both(tmp_path, capsys):
    a, b, out = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "cmp.json"
    a.write_text("rollout: {n: 2}\n")
    b.write_text("rollout: {n: 4}\n")
    assert main(["bench", "compare", "--configs", str(a), str(b), "--steps", "1", "--warmup", "1",
                 "--json", str(out), "--set", *[o for o in TINY if not o.startswith("rollout.n=")]]) == 0
    saved = json.loads(out.read_text())
    assert saved["of"] == "step" and saved["config_differences"]["rollout.n"] == [2, 4]
    for side, n in (("a", 2), ("b", 4)):
        rep = saved[side]
        assert [r["warmup"] for r in rep["runs"]] == [True, False]
        run = rep["runs"][1]
        assert run["trajectories"] == n and run["engine_stats"]["requests"] >= n
        phases = sum(run[f"{p}_s"] for p in ("rollout", "reward", "logprob", "update", "sync", "other"))
        assert phases == pytest.approx(run["step_s"])
        assert set(rep["summary"]) >= {"rollout_s", "update_s", "step_s", "trajectories_per_s"}
        assert len(run["uids"]) == 1 and 0 <= run["train_padding_fraction"] < 1
        assert 0 <= run["sys_s"] <= run["cpu_s"] and run["minor_faults"] >= 0
    assert "step_s" in saved["figures"] and "rollout_s" in capsys.readouterr().out
    assert (out.with_suffix("") / "step-a-a.json").exists()
