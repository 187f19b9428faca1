"""A run directory is one run (issue 17 item 5): a second run into it is refused unless asked to overwrite,
and a resume compares the saved config: what the checkpoint cannot take is refused, other changes are said."""

import json
from pathlib import Path

import pytest

from turnrl.config import ConfigError, load_config, to_dict
from turnrl.train.trainer import Trainer


def config(out, *extra):
    return load_config(None, [f"output_dir={out}", "model.name=tiny-random", *extra])


def fake_run(out: Path, cfg_overrides=()):
    """What a finished run leaves: metrics, trajectories and a checkpoint with its config."""
    (out / "checkpoints" / "step_000002").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (out / "trajectories.jsonl").write_text('{"step": 1}\n')
    state = {"step": 2, "data_position": 8, "config": to_dict(config(out, *cfg_overrides))}
    (out / "checkpoints" / "step_000002" / "trainer_state.json").write_text(json.dumps(state))
    (out / "checkpoints" / "latest").write_text("step_000002")
    (out / "notes.txt").write_text("mine")


def files(root):
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_new_run_into_an_earlier_one_is_refused_and_nothing_is_touched(tmp_path):
    fake_run(tmp_path)
    before = files(tmp_path)
    with pytest.raises(ConfigError) as err:
        Trainer(config(tmp_path))
    assert "already holds a run" in str(err.value) and "trainer.resume=latest" in str(err.value)
    assert "fresh output_dir" in str(err.value) and "trainer.overwrite=true" in str(err.value)
    assert files(tmp_path) == before


def test_overwrite_deletes_only_the_run_files(tmp_path):
    from turnrl.train.rundir import prepare_run_dir
    fake_run(tmp_path)
    prepare_run_dir(config(tmp_path, "trainer.overwrite=true"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_an_empty_or_fresh_directory_is_fine(tmp_path):
    from turnrl.train.rundir import prepare_run_dir
    assert prepare_run_dir(config(tmp_path / "new")).is_dir()
    (tmp_path / "new" / "config.yaml").write_text("{}")     # a run that died before its first step
    prepare_run_dir(config(tmp_path / "new"))


@pytest.mark.parametrize("change", ["model.lora.rank=0", "model.name=smollm2-135m-instruct", "algo.advantage=gae"])
def test_resume_refuses_what_the_checkpoint_cannot_take(tmp_path, change):
    fake_run(tmp_path, ["model.lora.rank=8"])
    with pytest.raises(ConfigError) as err:
        Trainer(config(tmp_path, "model.lora.rank=8", "trainer.resume=latest", change))
    assert change.split("=")[0] in str(err.value) and "cannot resume" in str(err.value)


def test_resume_says_what_changed(tmp_path, capsys):
    from turnrl.train.rundir import prepare_run_dir
    fake_run(tmp_path)
    prepare_run_dir(config(tmp_path, "trainer.resume=latest", "rollout.n=8", "trainer.optim.lr=1e-4",
                           "trainer.steps=50"))
    out = capsys.readouterr().out
    assert "resuming with a changed config" in out and "rollout.n: 4 -> 8" in out and "trainer.optim.lr" in out
    assert "trainer.steps" not in out                         # running longer is what resuming is for
