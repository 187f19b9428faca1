"""Live progress of a batch of trajectories: done / total, turns in flight, tokens/s and ETA.

On a terminal (mode "auto" with a TTY on stderr, or "on") it is a tqdm bar; otherwise a plain line at most
every `every_s` seconds, so CI logs stay short; mode "off" prints nothing. A background ticker refreshes the
display between completions, because a slow batch can go a long time without one while turns are still
being generated. Turns in flight come from a callable the caller passes (e.g. the number of requests its
engine is serving); tokens from `update(tokens=...)`. The ETA assumes the remaining trajectories finish at
the rate the finished ones did. `close` prints the final count on a line of its own.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable


class Progress:
    def __init__(self, total: int, desc: str, mode: str = "auto", every_s: float = 30.0,
                 in_flight: Callable[[], int] | None = None):
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"progress mode must be auto, on or off, got {mode!r}")
        self.total, self.desc, self.every_s, self.in_flight = total, desc, every_s, in_flight
        self.done = 0
        self.tokens = 0
        self.start = self.last = time.perf_counter()
        self.postfix: dict[str, Any] = {}
        self.quiet = mode == "off"
        self.bar = None
        if mode == "on" or (mode == "auto" and sys.stderr.isatty()):
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, dynamic_ncols=True, leave=False, unit="traj")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker = None
        if not self.quiet:
            self._ticker = threading.Thread(target=self._tick, name=f"progress-{desc}", daemon=True)
            self._ticker.start()

    def update(self, n: int = 1, tokens: int = 0, **postfix: Any) -> None:
        """`n` more trajectories done, `tokens` more tokens generated; `postfix` values are shown as key=value."""
        with self._lock:
            self.done += n
            self.tokens += tokens
            self.postfix.update(postfix)
            if self.bar is not None:
                self.bar.update(n)
                self.bar.set_postfix_str(self.status(), refresh=False)
            else:
                self._line(force=False)

    def status(self) -> str:
        """Turns in flight, tokens/s and the caller's postfix (the bar shows done/total and ETA itself)."""
        parts = []
        if self.in_flight is not None:
            try:
                parts.append(f"{int(self.in_flight())} turns in flight")
            except Exception:  # noqa: BLE001 - a broken counter must not break the run it reports on
                pass
        elapsed = time.perf_counter() - self.start
        if self.tokens:
            parts.append(f"{self.tokens / max(elapsed, 1e-9):.0f} tok/s")
        parts += [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.postfix.items()]
        return ", ".join(parts)

    def eta_s(self) -> float | None:
        elapsed = time.perf_counter() - self.start
        if self.done <= 0 or elapsed <= 0:
            return None
        return max(self.total - self.done, 0) / (self.done / elapsed)

    def _line(self, force: bool) -> None:
        now = time.perf_counter()
        if self.quiet or (not force and now - self.last < self.every_s):
            return
        self.last = now
        eta = self.eta_s()
        status = self.status()
        print(f"[{self.desc}] {self.done}/{self.total} trajectories, {_duration(now - self.start)} elapsed, "
              f"eta {_duration(eta) if eta is not None else '?'}" + (f", {status}" if status else ""),
              file=sys.stderr, flush=True)

    def _tick(self) -> None:
        interval = 1.0 if self.bar is not None else max(self.every_s, 0.05)
        while not self._stop.wait(interval):
            with self._lock:
                if self.bar is not None:
                    self.bar.set_postfix_str(self.status(), refresh=True)
                else:
                    self._line(force=False)

    def close(self) -> None:
        """Stop the display and print the final count (the last periodic line can be far behind it)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self.bar is not None:
            self.bar.close()
        with self._lock:
            self._line(force=True)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_table(rows: dict[str, Any], title: str = "") -> str:
    """A two-column table of metrics (floats with 4 significant digits)."""
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    width = max((len(k) for k in rows), default=0)
    lines = [title] if title else []
    lines += [f"  {k:<{width}}  {fmt(v)}" for k, v in rows.items()]
    return "\n".join(lines)
