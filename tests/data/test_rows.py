"""Rows from JSONL and Parquet files, in turnrl's shape and verl's, with file:row in every error."""

import json

import pytest

from turnrl.data import DataError, load_dataset, load_rows, task_from_row

VERL_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "system", "content": "Think step by step."},
               {"role": "user", "content": "Natalia sold 48 clips... how many?"}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "72"},
    "agent_name": "tool_agent",
    "extra_info": {
        "index": 7, "split": "train",
        "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"},
                                               "execute_kwargs": {"strict": True}}},
        "interaction_kwargs": {"name": "gsm8k", "query": "Natalia...", "ground_truth": "72"},
    },
}

TURNRL_ROW = {
    "uid": "q-1",
    "messages": [{"role": "user", "content": "What is 2+2?"}],
    "tools": ["calculator"],
    "tools_kwargs": {"check_answer": {"ground_truth": 4}},
    "interaction": {"name": "math_feedback", "ground_truth": "4"},
    "ground_truth": "4",
    "data_source": "toy",
    "extra": {"level": 1},
}


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def check_verl_task(task, position=0):
    assert task.uid == "openai/gsm8k-7"
    assert task.messages == VERL_ROW["prompt"]
    assert task.ground_truth == "72" and task.data_source == "openai/gsm8k" and task.index == 7
    assert task.tools is None                      # verl gives every row all configured tools
    assert task.tools_kwargs == {"calc_gsm8k_reward": {"ground_truth": "72"}}
    assert task.interaction == {"name": "gsm8k", "query": "Natalia...", "ground_truth": "72"}
    assert task.agent_name == "tool_agent"
    assert task.extra["split"] == "train"
    assert task.info["ground_truth"] == "72" and task.info["uid"] == "openai/gsm8k-7"


def test_turnrl_row():
    task = task_from_row(TURNRL_ROW, 0, "x:1")
    assert task.uid == "q-1" and task.tools == ["calculator"] and task.index == 0
    assert task.tools_kwargs == {"check_answer": {"ground_truth": 4}}
    assert task.interaction == {"name": "math_feedback", "ground_truth": "4"}
    assert task.extra == {"level": 1} and task.ground_truth == "4"


def test_string_prompt_becomes_a_user_message_and_none_fields_are_dropped():
    task = task_from_row({"prompt": "Hi", "data_source": "s"}, 3, "x:4")
    assert task.messages == [{"role": "user", "content": "Hi"}] and task.uid == "s-3"
    task = task_from_row({"messages": [{"role": "user", "content": "q", "name": None}]}, 0, "x:1")
    assert task.messages == [{"role": "user", "content": "q"}] and task.uid == "row-0"


def test_jsonl_turnrl_and_verl_rows(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [TURNRL_ROW, VERL_ROW])
    tasks = load_rows(path)
    assert [t.uid for t in tasks] == ["q-1", "openai/gsm8k-7"]
    check_verl_task(tasks[1])


def test_parquet_verl_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    other = json.loads(json.dumps(VERL_ROW))
    other["extra_info"] = {"index": 8, "split": "train",
                           "tools_kwargs": {"other_tool": {"create_kwargs": {"x": 1}}},
                           "interaction_kwargs": {"name": "gsm8k", "query": "q2", "ground_truth": "5"}}
    other["reward_model"]["ground_truth"] = "5"
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([VERL_ROW, other]), path)
    tasks = load_dataset(path=str(path))
    check_verl_task(tasks[0])
    # Parquet unifies struct fields across rows; the other row's absent tool must not appear as a tool
    assert tasks[1].tools_kwargs == {"other_tool": {"x": 1}}
    assert tasks[1].ground_truth == "5" and tasks[1].uid == "openai/gsm8k-8"
    assert load_dataset(path=str(path), max_rows=1)[0].uid == "openai/gsm8k-7"


@pytest.mark.parametrize("row, message", [
    ({"question": "no messages"}, "needs 'messages'"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "user"}]}, "message 0 must be a mapping with 'role' and 'content'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role 'robot'"),
    ({"messages": "hi", "tools_kwargs": ["calculator"]}, "'tools_kwargs' must map tool names"),
    ({"messages": "hi", "tools_kwargs": {"calculator": 3}}, "tools_kwargs['calculator'] must be a mapping"),
    ({"messages": "hi", "interaction": {"ground_truth": 1}}, "'interaction' must be a mapping with a 'name'"),
    ({"messages": "hi", "tools": "calculator"}, "'tools' must be a list of tool names"),
])
def test_row_errors_name_file_and_line(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [TURNRL_ROW, row])
    with pytest.raises(DataError) as err:
        load_rows(path)
    assert f"{path}:2" in str(err.value) and message in str(err.value)


def test_file_level_errors(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps(TURNRL_ROW) + "\n\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:3: not valid JSON"):
        load_rows(bad_json)
    with pytest.raises(DataError, match="does not exist"):
        load_rows(tmp_path / "missing.jsonl")
    csv = tmp_path / "rows.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DataError, match="unknown data format '.csv'"):
        load_rows(csv)
    with pytest.raises(DataError, match="exactly one"):
        load_dataset(path=str(csv), task="calculator")
    with pytest.raises(DataError, match="exactly one"):
        load_dataset()


def test_blank_lines_are_skipped_and_positions_count_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n" + json.dumps({"messages": "a"}) + "\n\n" + json.dumps({"messages": "b"}) + "\n")
    assert [(t.uid, t.index) for t in load_rows(path)] == [("row-0", 0), ("row-1", 1)]


def test_verl_agent_names_run_one_loop_and_unknown_ones_are_errors():
    row = dict(VERL_ROW, agent_name="single_turn_agent")
    assert task_from_row(row, 0, "x").tools is None        # it asks for tools: multi-turn whatever the name says
    bare = {"prompt": VERL_ROW["prompt"], "agent_name": "single_turn_agent"}
    assert task_from_row(bare, 0, "x").tools == []         # it asks for nothing: one turn, no tools, as in verl
    assert task_from_row({**bare, "agent_name": "tool_agent"}, 0, "x").tools is None
    with pytest.raises(DataError, match="unknown agent_name 'react_agent'; known: tool_agent, single_turn_agent"):
        task_from_row({**bare, "agent_name": "react_agent"}, 3, "data.parquet:row 3")


def test_parquet_with_mixed_rows_reads_null_filled_structs_as_absent(tmp_path):
    """pyarrow (and pandas, datasets) give every row every struct field: a tool row of a file that also has
    interaction rows reads back with `interaction_kwargs: {name: None, ...}`, an interaction row with
    `tools_kwargs: {tool: None}` (issue 16, item 5)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    prompt = [{"role": "user", "content": "count"}]
    rows = [{"prompt": prompt, "extra_info": {"index": 0, "tools_kwargs": {"counter": {"create_kwargs": {"start": 2}}},
                                              "interaction_kwargs": {}}},
            {"prompt": prompt, "extra_info": {"index": 1, "tools_kwargs": {},
                                              "interaction_kwargs": {"name": "retry", "ground_truth": "4"}}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mixed.parquet")
    read = pq.read_table(tmp_path / "mixed.parquet").to_pylist()
    assert read[0]["extra_info"]["interaction_kwargs"] == {"name": None, "ground_truth": None}
    assert read[1]["extra_info"]["tools_kwargs"] == {"counter": None}
    tool_row, user_row = load_rows(tmp_path / "mixed.parquet")
    assert (tool_row.tools_kwargs, tool_row.interaction) == ({"counter": {"start": 2}}, None)
    assert (user_row.tools_kwargs, user_row.interaction) == ({}, {"name": "retry", "ground_truth": "4"})
    # a row that does give interaction kwargs but no name is still an error
    with pytest.raises(DataError, match="'name' string"):
        task_from_row({"prompt": prompt, "extra_info": {"interaction_kwargs": {"name": None, "ground_truth": "4"}}},
                      0, "row 0")
