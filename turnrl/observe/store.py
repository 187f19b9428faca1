"""Trajectories on disk: one JSON object per line (messages + ledger), read back as `Trajectory`.

Known secrets are redacted from what is written (`turnrl.config.secrets.redact`): a tool or an error message
that echoes an API key does not put it in the traces or the viewer.
"""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Any, Iterator

from turnrl.config.secrets import redact
from turnrl.ledger import Trajectory


def write_trajectories(path: Path, trajectories: list[Trajectory], append: bool = False,
                       **fields: Any) -> None:
    """Write (or append) trajectories; `fields` (e.g. step=3, split="train") are stored on each line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for traj in trajectories:
            record = traj.to_dict()
            record.update(fields)
            f.write(redact(json.dumps(record, ensure_ascii=False, default=_jsonable)) + "\n")


def _jsonable(value: Any) -> Any:
    """Values user tools and rewards put in metrics (numpy/torch scalars and arrays, Fractions, sets)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return str(value)


def read_trajectories(path: Path) -> Iterator[tuple[Trajectory, dict[str, Any]]]:
    """(trajectory, extra fields) for every line."""
    known = set(Trajectory.__dataclass_fields__)
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                extra = {k: record.pop(k) for k in list(record) if k not in known}
                yield Trajectory.from_dict(record), extra
