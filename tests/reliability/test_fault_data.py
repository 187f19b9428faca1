"""Bad dataset rows: each is refused when the data is loaded, before any step, with the file and row named.

A row that got through would fail in every rollout that drew it (or, worse, train on a broken prompt), so
missing fields and wrong types are load errors, never per-trajectory surprises.
"""

import json

import pytest

from turnrl.cli import main
from turnrl.data import DataError, load_dataset

GOOD = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "ground_truth": "4"}
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("row, message", [
    ({"ground_truth": "4"}, "a row needs 'messages' (or verl's 'prompt')"),
    ([1, 2], "a row must be a mapping, got list"),
    ({"messages": {"role": "user"}}, "'messages' must be a non-empty list of chat messages"),
    ({"messages": []}, "'messages' must be a non-empty list of chat messages"),
    ({"messages": [{"content": "hi"}]}, "message 0 must be a mapping with 'role' and 'content'"),
    ({"messages": [{"role": "user", "content": None}]}, "message 0 must be a mapping with 'role' and 'content'"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "message 0 has unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": 5}]}, "message 0's 'content' must be a string, got int"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
     "message 0's 'content' must be a string, got list"),
    ({"messages": USER, "tools": "calculator"}, "'tools' must be a list of tool names"),
    ({"messages": USER, "tools_kwargs": [1]}, "'tools_kwargs' must map tool names to create kwargs"),
    ({"messages": USER, "tools_kwargs": {"calculator": 3}}, "tools_kwargs['calculator'] must be a mapping"),
    ({"messages": USER, "interaction": "guess_number"}, "'interaction' must be a mapping with a 'name' string"),
    ({"messages": USER, "interaction": {"name": 5}}, "'interaction' must be a mapping with a 'name' string"),
    ({"messages": USER, "extra": [1, 2]}, "'extra' must be a mapping, got list"),
    ({"prompt": USER, "extra_info": [1]}, "'extra_info' must be a mapping, got list"),
    ({"prompt": USER, "reward_model": "4"}, "'reward_model' must be a mapping, got str"),
])
def test_a_bad_row_is_a_load_error_naming_file_and_line(tmp_path, row, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as info:
        load_dataset(path=str(path))
    assert str(info.value).startswith(f"{path}:3: {message}")


def test_broken_json_and_parquet_rows_are_named_too(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(GOOD) + '\n{"messages": [}\n')
    with pytest.raises(DataError, match=rf"^{path}:2: not valid JSON"):
        load_dataset(path=str(path))
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    table = pa.Table.from_pylist([{"prompt": json.dumps(USER), "data_source": "x"},
                                  {"prompt": None, "data_source": "x"}])
    pq.write_table(table, tmp_path / "rows.parquet")
    with pytest.raises(DataError, match=r"rows\.parquet:row 1: a row needs 'messages'"):
        load_dataset(path=str(tmp_path / "rows.parquet"))


def test_training_on_a_bad_file_stops_before_any_step(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps({"messages": [{"role": "user", "content": 7}]}) + "\n")
    (tmp_path / "empty.yaml").write_text("{}\n")
    out = tmp_path / "run"
    code = main(["train", str(tmp_path / "empty.yaml"), "model.name=tiny-random", f"data.train.path={path}",
                 "logging.sinks=[]", "logging.progress=off", f"output_dir={out}"])
    assert code == 2
    assert f"error: {path}:2: message 0's 'content' must be a string, got int" in capsys.readouterr().err
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
