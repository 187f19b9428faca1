"""Metrics sinks: JSONL scalars and tables, MLflow (a stand-in module, and the real one when installed)."""

import importlib.util
import json
import sys
import types

import pytest

from turnrl.observe.metrics import MetricsLogger, TensorBoardSink, generation_rows, read_metrics

ROWS = [{"prompt": "What is 1 + 1?", "answer": "#### 2", "reward": 1.0},
        {"prompt": "What is 2 * 3?", "answer": "#### 5", "reward": float("nan")}]


def test_jsonl_writes_metrics_and_tables(tmp_path):
    logger = MetricsLogger(tmp_path, [])
    logger.log(1, {"reward/mean": 0.5, "kl/ref": float("inf")})
    logger.log_table(1, "eval/generations", ROWS)
    logger.log_table(2, "eval/generations", ROWS[:1])
    logger.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "reward/mean": 0.5, "kl/ref": None}]
    tables = [json.loads(line) for line in (tmp_path / "tables.jsonl").read_text().splitlines()]
    assert [(t["step"], t["name"], len(t["rows"])) for t in tables] == [(1, "eval/generations", 2),
                                                                       (2, "eval/generations", 1)]
    assert tables[0]["rows"][1] == {"prompt": "What is 2 * 3?", "answer": "#### 5", "reward": None}


def test_console_leaves_tables_out(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, ["console"])
    logger.log_table(1, "eval/generations", ROWS)
    logger.close()
    assert capsys.readouterr().out == ""


def test_tensorboard_tables_are_markdown_text():
    texts = []
    sink = TensorBoardSink.__new__(TensorBoardSink)     # the writer only: tensorboard is optional
    sink.writer = types.SimpleNamespace(add_text=lambda name, text, step: texts.append((name, text, step)))
    sink.log_table(2, "eval/generations", [{"prompt": "a|b", "answer": "x\ny"}])
    assert texts == [("eval/generations", "| prompt | answer |\n| --- | --- |\n| a\\|b | x<br>y |", 2)]


def test_wandb_tables(tmp_path, monkeypatch):
    logged = []
    run = types.SimpleNamespace(log=lambda data, step: logged.append((data, step)), finish=lambda: None)
    fake = types.SimpleNamespace(init=lambda **kwargs: run,
                                 Table=lambda columns, data: ("table", columns, data))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = MetricsLogger(tmp_path, ["wandb"])
    logger.log_table(4, "eval/generations", ROWS[:1])
    logger.close()
    assert logged == [({"eval/generations": ("table", ["prompt", "answer", "reward"],
                                             [[ROWS[0]["prompt"], ROWS[0]["answer"], 1.0]])}, 4)]


def test_unknown_sink_lists_mlflow(tmp_path):
    with pytest.raises(ValueError, match="known: console, tensorboard, wandb, mlflow"):
        MetricsLogger(tmp_path, ["neptune"])


def test_missing_mlflow_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)     # import mlflow -> ImportError
    with pytest.raises(ValueError, match=r"pip install 'turnrl\[mlflow\]'"):
        MetricsLogger(tmp_path, ["mlflow"])


def test_mlflow_sink_calls(tmp_path, monkeypatch):
    calls = []
    fake = types.SimpleNamespace(
        set_tracking_uri=lambda uri: calls.append(("uri", uri)),
        set_experiment=lambda name: calls.append(("experiment", name)),
        start_run=lambda run_name=None: calls.append(("start", run_name)),
        log_params=lambda params: calls.append(("params", params)),
        log_metrics=lambda metrics, step: calls.append(("metrics", metrics, step)),
        log_table=lambda data, artifact_file: calls.append(("table", data, artifact_file)),
        end_run=lambda: calls.append(("end",)))
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    logger = MetricsLogger(tmp_path, ["mlflow"], project="proj", run_name="r1", config={"algo": {"kl_coef": 0.1}})
    logger.log(3, {"reward/mean": 0.5, "kl/ref": float("nan"), "note": "text", "flag": True})
    logger.log_table(3, "eval/generations", ROWS)
    logger.close()
    assert calls == [
        ("uri", f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"), ("experiment", "proj"), ("start", "r1"),
        ("params", {"algo.kl_coef": "0.1"}), ("metrics", {"reward/mean": 0.5}, 3),
        ("table", {"prompt": [r["prompt"] for r in ROWS], "answer": [r["answer"] for r in ROWS],
                   "reward": [r["reward"] for r in ROWS]}, "eval/generations/step_000003.json"),
        ("end",)]


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None or importlib.util.find_spec("pandas") is None,
                    reason="mlflow (with pandas) is optional: pip install 'turnrl[mlflow]'")
def test_real_mlflow_file_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    logger = MetricsLogger(tmp_path, ["mlflow"], project="turnrl-test", run_name="t", config={"seed": 0})
    logger.log(1, {"reward/mean": 0.25})
    logger.log_table(1, "eval/generations", ROWS[:1])
    logger.close()
    metric = next((tmp_path / "mlruns").glob("*/*/metrics/reward/mean"))
    assert metric.read_text().split()[1:] == ["0.25", "1"]
    table = next((tmp_path / "mlruns").glob("*/*/artifacts/eval/generations/step_000001.json"))
    assert json.loads(table.read_text())["data"] == [[ROWS[0]["prompt"], ROWS[0]["answer"], 1.0]]


def test_generation_rows(ledger):
    rows = generation_rows([t for t, _ in ledger[-3:]])
    assert [r["termination"] for r in rows] == [t.termination for t, _ in ledger[-3:]]
    first = ledger[-3][0]
    question = [m for m in first.messages if m["role"] == "user"][-1]["content"]
    assert rows[0]["prompt"] == question and question.startswith("What is")
    assert rows[0]["answer"] == first.turns[-1].text and "####" in rows[0]["answer"]
    assert rows[0]["ground_truth"] == first.info["ground_truth"] and rows[0]["reward"] == first.reward
