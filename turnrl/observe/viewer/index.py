"""A bounded index over a run directory's trajectories.jsonl, kept up to date while training appends to it.

Each line is one `Trajectory.to_dict()` plus the trainer's `step` and `split` (rollout directories have
neither: their lines count as step 0, split "rollout"). The index keeps, per (step, split), at most
`per_step` trajectories: a summary row for listing and filtering, and the byte offset of the line, so a
trajectory is parsed in full only when it is opened. Lines past the bound are skipped without parsing
them: `write_trajectories` appends the extra fields last, so step and split can be read off the line's end.
`refresh` reads only what was appended since the last call (complete lines only: a line being written
is picked up next time).
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.ledger import Source, Trajectory
from turnrl.observe.conversation import prompt_text

TAIL = re.compile(rb'"step": (-?\d+), "split": "([^"\\]*)"\}\s*$')
ROLLOUT = "rollout"
INVALID_TOOL = "(invalid)"   # a call whose name could not be parsed


@dataclass
class Entry:
    offset: int
    length: int
    row: dict[str, Any]


def load_line(record: dict[str, Any]) -> tuple[Trajectory, int, str]:
    """(trajectory, step, split) from one parsed line."""
    known = set(Trajectory.__dataclass_fields__)
    extra = {k: record.pop(k) for k in list(record) if k not in known}
    step = extra.get("step")
    return Trajectory.from_dict(record), int(step) if step is not None else 0, str(extra.get("split") or ROLLOUT)


def summary_row(tid: int, line: int, traj: Trajectory, step: int, split: str) -> dict[str, Any]:
    """What the list shows and filters on; `tid` is the index's id, `line` the line number in the file."""
    advantage = traj.metrics.get("advantage")
    return {
        "id": tid, "line": line, "step": step, "split": split, "group_id": traj.group_id,
        "sample_index": traj.sample_index,
        "reward": traj.reward, "termination": traj.termination or "(none)", "masked": traj.masked,
        "parity": traj.parity, "turns": len(traj.turns),
        "tools": sorted({c.name or INVALID_TOOL for t in traj.turns for c in t.tool_calls}),
        "errors": sorted({e.kind for e in traj.errors}),
        "data_source": str(traj.info.get("data_source") or ""),
        "advantage": float(advantage) if isinstance(advantage, (int, float)) else None,
        "policy_tokens": traj.n_tokens(Source.POLICY),
        "prompt": prompt_text(traj)[:160],
    }


class RunIndex:
    def __init__(self, run_dir: Path, per_step: int = 32):
        if per_step <= 0:
            raise ValueError(f"per_step must be positive, got {per_step}")
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "trajectories.jsonl"
        if not self.path.is_file():
            raise ValueError(f"{self.path} does not exist: pass a directory written by `turnrl rollout`, "
                             "`turnrl train` or `turnrl eval`")
        self.per_step = per_step
        self.entries: list[Entry] = []
        self.seen: Counter[tuple[int, str]] = Counter()   # lines per (step, split), kept or skipped
        self._offset = 0
        self._lines = 0
        self.bad_lines = 0
        self._lock = threading.Lock()
        self.refresh()

    def refresh(self) -> None:
        with self._lock, open(self.path, "rb") as f:
            f.seek(self._offset)
            for line in f:
                if not line.endswith(b"\n"):
                    break
                offset, number = self._offset, self._lines
                self._offset += len(line)
                self._lines += 1
                if line.strip():
                    self._add(line, offset, number)

    def _add(self, line: bytes, offset: int, number: int) -> None:
        tail = TAIL.search(line[-300:])
        if tail is not None:
            key = (int(tail.group(1)), tail.group(2).decode())
            self.seen[key] += 1
            if self.seen[key] > self.per_step:
                return
        try:
            traj, step, split = load_line(json.loads(line))
        except (ValueError, TypeError) as exc:   # e.g. a line cut short by a crash, then appended to
            self.bad_lines += 1
            print(f"[turnrl] view: skipped line {number + 1} of {self.path}: {type(exc).__name__}: {exc}"[:300],
                  file=sys.stderr)
            return
        if tail is None:
            self.seen[step, split] += 1
            if self.seen[step, split] > self.per_step:
                return
        self.entries.append(Entry(offset, len(line), summary_row(len(self.entries), number, traj, step, split)))

    def steps(self) -> list[dict[str, Any]]:
        """One entry per (step, split): shown and saved counts, mean reward of the shown ones."""
        rewards: dict[tuple[int, str], list[float]] = {}
        for e in self.entries:
            rewards.setdefault((e.row["step"], e.row["split"]), []).append(e.row["reward"])
        return [{"step": s, "split": sp, "shown": len(r), "saved": self.seen[s, sp], "reward_mean": sum(r) / len(r)}
                for (s, sp), r in sorted(rewards.items())]

    def filters(self) -> dict[str, Any]:
        """The values each filter can take, over the whole index."""
        rows = [e.row for e in self.entries]
        rewards = [r["reward"] for r in rows]
        return {
            "splits": sorted({r["split"] for r in rows}),
            "terminations": sorted({r["termination"] for r in rows}),
            "errors": sorted({k for r in rows for k in r["errors"]}),
            "tools": sorted({k for r in rows for k in r["tools"]}),
            "data_sources": sorted({r["data_source"] for r in rows if r["data_source"]}),
            "reward_min": min(rewards, default=0.0), "reward_max": max(rewards, default=0.0),
        }

    def rows(self, step: int | None = None, split: str | None = None) -> list[dict[str, Any]]:
        return [e.row for e in self.entries
                if (step is None or e.row["step"] == step) and (split is None or e.row["split"] == split)]

    def load(self, tid: int) -> tuple[Trajectory, dict[str, Any]]:
        if not 0 <= tid < len(self.entries):
            raise KeyError(f"no trajectory {tid}")
        entry = self.entries[tid]
        with open(self.path, "rb") as f:
            f.seek(entry.offset)
            traj, _, _ = load_line(json.loads(f.read(entry.length)))
        return traj, entry.row

    def group(self, tid: int) -> list[int]:
        """The indexed samples of the same prompt at the same step (a GRPO group), by sample index."""
        row = self.entries[tid].row
        members = [e.row for e in self.entries if e.row["group_id"] == row["group_id"]
                   and e.row["step"] == row["step"] and e.row["split"] == row["split"]]
        return [r["id"] for r in sorted(members, key=lambda r: (r["sample_index"], r["id"]))]
