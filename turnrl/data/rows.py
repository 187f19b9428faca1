"""Rows -> `Task`s. Accepts turnrl's own row shape and verl's (parquet or JSONL).

turnrl row: `messages` (chat list), optional `tools` (names; default: every configured tool),
`tools_kwargs` ({tool: create kwargs}), `interaction` ({name, ...start kwargs}), `ground_truth`,
`data_source`, `extra` (anything). verl row: `prompt`, `reward_model.ground_truth`, `data_source`,
`agent_name`, `extra_info.{index, tools_kwargs[tool].create_kwargs, interaction_kwargs{name, ...}}`.

Parquet files whose rows mix modes (pyarrow, pandas and datasets write them so) read back with every struct
field on every row, null-filled where the row had none: `interaction_kwargs: {name: None, ...}` on a tool
row, `tools_kwargs: {tool: None}` on an interaction row. None values are dropped on reading (`_plain`), so
such a row has no interaction and such a tool has no create kwargs.

verl picks an agent loop per row by `agent_name` and silently runs a row without one single-turn. turnrl
runs one loop for every row: a row that asks for tools (`tools_kwargs`) or an interaction is multi-turn
whatever its `agent_name`; `single_turn_agent` on a row that asks for neither gets no tools (one turn, as in
verl); any other name is an error that lists the known ones (`AGENT_NAMES`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """Bad input data; the message names the file and row."""


@dataclass
class Task:
    uid: str
    messages: list[dict[str, Any]]
    tools: list[str] | None = None                 # None: all configured tools
    tools_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    interaction: dict[str, Any] | None = None      # {"name": ..., **start kwargs}
    ground_truth: Any = None
    data_source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    index: int = 0
    agent_name: str | None = None
    demonstration: list[dict[str, Any]] | None = None  # a correct continuation of `messages` (for SFT)

    @property
    def info(self) -> dict[str, Any]:
        return {"uid": self.uid, "index": self.index, "data_source": self.data_source,
                "ground_truth": self.ground_truth, "extra": self.extra, "interaction": self.interaction}


def _messages(value: Any, where: str) -> list[dict[str, Any]]:
    if hasattr(value, "tolist"):  # numpy arrays from parquet
        value = value.tolist()
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: 'messages' must be a non-empty list of chat messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {i} must be a mapping with 'role' and 'content'")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise DataError(f"{where}: message {i} has unknown role {m['role']!r}")
        if not isinstance(m["content"], str):  # chat templates concatenate it: fail here, not in every rollout
            raise DataError(f"{where}: message {i}'s 'content' must be a string, got {type(m['content']).__name__}")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _plain(value: Any) -> Any:
    """numpy/pyarrow containers from parquet -> plain Python."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


AGENT_NAMES = ("tool_agent", "single_turn_agent", "collabllm_agent")   # verl's agent loops, all run by ours
VERL_TOOL_KWARGS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")


def _create_kwargs(value: Any, where: str) -> dict[str, Any]:
    """A tool's create kwargs: verl's `{create_kwargs: {...}, execute_kwargs: ...}` or a plain mapping."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DataError(f"{where} must be a mapping of create kwargs, got {type(value).__name__}")
    if any(k in value for k in VERL_TOOL_KWARGS):
        return dict(value.get("create_kwargs") or {})
    return dict(value)


def task_from_row(row: dict[str, Any], index: int, where: str) -> Task:
    row = _plain(row)
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a mapping, got {type(row).__name__}")
    for key in ("extra_info", "reward_model", "extra"):
        if not isinstance(row.get(key) or {}, dict):
            raise DataError(f"{where}: '{key}' must be a mapping, got {type(row[key]).__name__}")
    extra_info = row.get("extra_info") or {}
    if "messages" in row:
        messages = _messages(row["messages"], where)
    elif "prompt" in row:
        messages = _messages(row["prompt"], where)
    else:
        raise DataError(f"{where}: a row needs 'messages' (or verl's 'prompt')")
    ground_truth = row.get("ground_truth", (row.get("reward_model") or {}).get("ground_truth"))
    tools_kwargs = row.get("tools_kwargs", extra_info.get("tools_kwargs")) or {}
    if not isinstance(tools_kwargs, dict):
        raise DataError(f"{where}: 'tools_kwargs' must map tool names to create kwargs")
    tools_kwargs = {k: _create_kwargs(v, f"{where}: tools_kwargs['{k}']") for k, v in tools_kwargs.items()}
    interaction = row.get("interaction", extra_info.get("interaction_kwargs"))
    if interaction == {}:  # parquet null-fills the struct on rows of a file that mixes modes: no interaction
        interaction = None
    if interaction is not None and (not isinstance(interaction, dict) or not isinstance(interaction.get("name"), str)):
        raise DataError(f"{where}: 'interaction' must be a mapping with a 'name' string")
    tools = row.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, str) for t in tools)):
        raise DataError(f"{where}: 'tools' must be a list of tool names")
    agent_name = row.get("agent_name") or None
    if agent_name is not None and agent_name not in AGENT_NAMES:
        raise DataError(f"{where}: unknown agent_name {agent_name!r}; known: {', '.join(AGENT_NAMES)} (turnrl runs "
                        "one agent loop: a row with tools or an interaction is multi-turn whatever its agent_name)")
    if agent_name == "single_turn_agent" and tools is None and not tools_kwargs and interaction is None:
        tools = []
    idx = extra_info.get("index", row.get("index", index))
    return Task(uid=str(row.get("uid", f"{row.get('data_source', 'row')}-{idx}")), messages=messages,
                tools=tools, tools_kwargs=tools_kwargs, interaction=dict(interaction) if interaction else None,
                ground_truth=ground_truth, data_source=str(row.get("data_source", "")),
                extra=dict(row.get("extra", extra_info)), index=int(idx) if isinstance(idx, int) else index,
                agent_name=agent_name)


def _some(tasks: list[Task], path: Path) -> list[Task]:
    if not tasks:
        raise DataError(f"data file '{path}' holds no rows")
    return tasks


def load_rows(path: str | Path) -> list[Task]:
    path = Path(path)
    if path.is_dir():
        raise DataError(f"data path '{path}' is a directory; give a .jsonl or .parquet file")
    if not path.is_file():
        raise DataError(f"data file '{path}' does not exist")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError("reading Parquet needs pyarrow: pip install pyarrow") from None
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
            raise DataError(f"data file '{path}' is not a Parquet file pyarrow can read "
                            f"({type(exc).__name__}: {exc})") from None
        return _some([task_from_row(r, i, f"{path}:row {i}") for i, r in enumerate(rows)], path)
    if path.suffix in (".jsonl", ".json"):
        tasks = []
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as exc:
            raise DataError(f"data file '{path}' is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{i + 1}: not valid JSON ({exc.msg})") from None
            tasks.append(task_from_row(row, len(tasks), f"{path}:{i + 1}"))
        return _some(tasks, path)
    raise DataError(f"'{path}': unknown data format '{path.suffix}'; use .jsonl or .parquet")
