"""The run setup and the after-step record every trainer shares (turnrl/train/setup.py)."""

import json

import pytest

from turnrl.config import load_config
from turnrl.train.health import AllMaskedError
from turnrl.train.setup import DataOrder, StepRecord, open_logger, set_up_run, train_data


def config(tmp_path, *extra):
    return load_config(None, ["model.name=tiny-random", "data.train.task=calculator", "data.train.size=5",
                              "logging.sinks=[]", f"output_dir={tmp_path / 'run'}", *extra])


def test_set_up_run_writes_the_config_and_refuses_an_earlier_run(tmp_path):
    cfg = config(tmp_path)
    run = set_up_run(cfg)
    assert (run.out / "config.yaml").exists() and run.template.tokenizer is not None
    (run.out / "metrics.jsonl").write_text("{}\n")          # the run wrote something
    with pytest.raises(Exception, match="overwrite|resume"):
        set_up_run(cfg)


def test_the_record_logs_every_step_saves_on_schedule_and_stops_on_masked_steps(tmp_path):
    cfg = config(tmp_path, "trainer.steps=5", "trainer.save_every=2", "trainer.max_masked_steps=2")
    run = set_up_run(cfg)
    record = StepRecord(cfg, run.out, open_logger(cfg, run.out))
    due = [record.add(step, {"reward/mean": 0.5, "trajectories": 4}) for step in range(1, 5)]
    assert due == [False, True, False, True] and record.add(5, {"reward/mean": 0.1}) is True   # the last step
    logged = [json.loads(line) for line in (run.out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3, 4, 5] and len(record.history) == 5
    masked = {"trajectories": 4, "masked": 4, "errors/tool_error": 4}
    record.add(6, masked)
    with pytest.raises(AllMaskedError):
        record.add(7, masked)


def test_train_data_comes_in_a_seeded_order_that_survives_a_resume(tmp_path):
    cfg = config(tmp_path, "data.shuffle=true")
    first = [t.uid for t in train_data(cfg).take(12)]
    again = train_data(cfg)
    again.take(7)
    resumed = DataOrder(again.tasks, cfg.seed, True, position=again.position)
    assert [t.uid for t in resumed.take(5)] == first[7:] and sorted(first[:5]) == sorted(first[5:10])
