"""One line per repeat of `turnrl bench rollout` JSON files: both phases' wall time, the ratio, and the fast engine's
admission and wait counters (engine_stats) and garbage-collection pauses, so A/B runs read side by side.

    python benchmarks/fast_prefix/summarize.py runs/fast_prefix/*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def lines(path: Path) -> list[str]:
    report = json.loads(path.read_text())
    if "runs" not in report:
        return []
    out = []
    for i, run in enumerate(report["runs"]):
        multi, offline = run["multi_turn"], run["offline"]
        m, o = multi.get("engine_stats", {}), offline.get("engine_stats", {})
        out.append(f"{path.stem:<36} {i:>2}{'w' if run.get('warmup') else ' '} multi {multi['seconds']:5.2f} s offline {offline['seconds']:5.2f} s "
                   f"ratio {run['ratio']:.3f} | multi: {m.get('admissions', 0):>3} admissions "
                   f"admit {m.get('admit_s', 0):.3f} s wait {m.get('wait_s', 0):.3f} s busy {m.get('busy_s', 0):.3f} s "
                   f"graphs +{m.get('admit_captured', m.get('admit_graph_captured', 0))}/"
                   f"{m.get('admit_replayed', m.get('admit_graph_replayed', 0))} "
                   f"loop cpu {multi.get('loop_cpu_s', 0):.2f} s{_gc(multi)} | offline: {o.get('admissions', 0):>3} "
                   f"admissions admit {o.get('admit_s', 0):.3f} s{_gc(offline)}")
    return out


def _gc(phase: dict) -> str:
    """Garbage-collection pauses in the phase: all of them, and the full collections (files from before the
    counter have none)."""
    gc = phase.get("gc")
    return f" gc {gc['time/gc_pause_s']:.3f} s ({gc['gc/full_collections']} full)" if gc else ""


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print("\n".join(lines(Path(name))))
