"""Trajectories on disk: one JSON object per line (messages + ledger), read back as `Trajectory`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from turnrl.ledger import Trajectory


def write_trajectories(path: Path, trajectories: list[Trajectory], append: bool = False,
                       **fields: Any) -> None:
    """Write (or append) trajectories; `fields` (e.g. step=3, split="train") are stored on each line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for traj in trajectories:
            record = traj.to_dict()
            record.update(fields)
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def read_trajectories(path: Path) -> Iterator[tuple[Trajectory, dict[str, Any]]]:
    """(trajectory, extra fields) for every line."""
    known = set(Trajectory.__dataclass_fields__)
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                extra = {k: record.pop(k) for k in list(record) if k not in known}
                yield Trajectory.from_dict(record), extra
