"""Compare two benchmark reports figure by figure: B / A of the medians, and which side is better.

A figure is any entry of a report's `summary` (`{min, median, max}` over repeats or steps). Its direction is
read from its name: `*_per_s`, `*tflops*`, `*mfu*` and `ratio` are better higher; other `*_s` figures are
seconds, better lower. `--configs A.yaml B.yaml` first runs `turnrl bench step` on each config, each in its
own process (an engine's memory and threads go away with it), with the same overrides and step counts.
The config keys that differ between the two reports are listed, so a ratio is never read without its cause.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def direction(name: str) -> int:
    """+1: higher is better, -1: lower is better, 0: neither."""
    if name.endswith("_per_s") or "tflops" in name or "mfu" in name or name == "ratio":
        return 1
    if name.endswith("_s"):
        return -1
    return 0


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): data}


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    if a.get("benchmark") != b.get("benchmark"):
        raise ValueError(f"cannot compare a '{a.get('benchmark')}' report with a '{b.get('benchmark')}' report")
    figures = {}
    for name, sa in a.get("summary", {}).items():
        sb = b.get("summary", {}).get(name)
        if not isinstance(sa, dict) or not isinstance(sb, dict) or "median" not in sa or "median" not in sb:
            continue
        ma, mb = sa["median"], sb["median"]
        ratio = mb / ma if ma else None
        sign = direction(name)
        better = None
        if ratio is not None and sign:
            better = ratio if sign > 0 else (1 / ratio if ratio else None)   # > 1: B is better
        figures[name] = {"a": ma, "b": mb, "b_over_a": ratio, "b_better_by": better,
                         "higher_is_better": None if sign == 0 else sign > 0, "a_spread": sa, "b_spread": sb}
    ca, cb = flatten(a.get("config", {})), flatten(b.get("config", {}))
    differ = {k: [ca.get(k), cb.get(k)] for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k)}
    loads = [r.get("machine", {}).get("loadavg") for r in (a, b)]
    return {"benchmark": "compare", "of": a.get("benchmark"), "figures": figures, "config_differences": differ,
            "loadavg": loads}


def run_step_reports(configs: list[str], overrides: list[str], steps: int, warmup: int, out_dir: Path
                     ) -> list[dict[str, Any]]:
    """`turnrl bench step` on each config, each in a fresh process; the reports are kept in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    reports = []
    for i, config in enumerate(configs):
        path = out_dir / f"step-{'ab'[i]}-{Path(config).stem}.json"
        cmd = [sys.executable, "-m", "turnrl", "bench", "step", config, *overrides, "--steps", str(steps),
               "--warmup", str(warmup), "--json", str(path)]
        print(f"[bench compare] {' '.join(cmd)}", flush=True)
        result = subprocess.run(cmd)
        if result.returncode != 0:
            raise RuntimeError(f"turnrl bench step {config} failed with exit status {result.returncode}")
        reports.append(json.loads(path.read_text()))
    return reports


def format_comparison(result: dict[str, Any], names: tuple[str, str] = ("A", "B")) -> str:
    a, b = names
    lines = [f"{result['of']} benchmark: A = {a}, B = {b}",
             f"  {'figure (median)':<30} {'A':>12} {'B':>12} {'B/A':>8}  better"]
    for name, f in result["figures"].items():
        ratio = f"{f['b_over_a']:.3f}" if f["b_over_a"] is not None else "-"
        if f["b_better_by"] is None:
            verdict = ""
        elif f["b_better_by"] >= 1:
            verdict = f"B by {f['b_better_by']:.2f}x"
        else:
            verdict = f"A by {1 / f['b_better_by']:.2f}x"
        lines.append(f"  {name:<30} {f['a']:>12.4g} {f['b']:>12.4g} {ratio:>8}  {verdict}")
    differ = result["config_differences"]
    shown = [k for k in differ if not k.startswith(("output_dir", "logging.run_name"))]
    if shown:
        lines.append("config differences (A -> B):")
        lines += [f"  {k}: {differ[k][0]!r} -> {differ[k][1]!r}" for k in shown[:30]]
        if len(shown) > 30:
            lines.append(f"  ... and {len(shown) - 30} more (see the JSON)")
    la, lb = result["loadavg"]
    if la and lb:
        lines.append(f"load average (1/5/15 min) at the end: A {la[0]:.2f}/{la[1]:.2f}/{la[2]:.2f}, "
                     f"B {lb[0]:.2f}/{lb[1]:.2f}/{lb[2]:.2f}")
    return "\n".join(lines)
