"""Live progress: a tqdm bar on a terminal; on a pipe, a plain line every `every_s` seconds (quiet CI logs)."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    def __init__(self, total: int, desc: str, mode: str = "auto", every_s: float = 30.0):
        self.total, self.desc, self.every_s = total, desc, every_s
        self.done = 0
        self.start = self.last = time.perf_counter()
        self.postfix: dict[str, Any] = {}
        enabled = mode == "on" or (mode == "auto" and sys.stderr.isatty())
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, dynamic_ncols=True, leave=False)
        self.quiet = mode == "off"

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.done += n
        self.postfix.update(postfix)
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(self.postfix, refresh=False)
            return
        now = time.perf_counter()
        if not self.quiet and now - self.last >= self.every_s:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            extra = " ".join(f"{k}={v}" for k, v in self.postfix.items())
            print(f"[{self.desc}] {self.done}/{self.total} eta {eta:.0f}s {extra}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def format_table(rows: dict[str, Any], title: str = "") -> str:
    """A two-column table of metrics (floats with 4 significant digits)."""
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    width = max((len(k) for k in rows), default=0)
    lines = [title] if title else []
    lines += [f"  {k:<{width}}  {fmt(v)}" for k, v in rows.items()]
    return "\n".join(lines)
