"""A CPU decode step's weight products, `linear` (MKL) against turnrl's skinny kernel (turnrl/engines/cpu_gemm.py).

    PYTHONPATH=. python benchmarks/cpu_gemm_probe.py [--rows 1,2,4,8,12,16] [--json out.json]

SmolLM2-135M's shapes in float32: the body's 210 products as a decode step runs them (q, k, v, o, gate, up, down
for each of 30 layers, each with its own weight, 425 MB, so none stays in the caches), then the head (49,152 x
576, 113 MB). ms for the whole set, best of `--repeats`, and the weights' bytes over that time; the largest
difference of the kernel's outputs from `linear`'s.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from turnrl.engines.cpu_gemm import load

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
HEAD = (49152, 576)


def best_ms(fn, pairs, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for x, w in pairs:
            fn(x, w)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,12,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args()
    kernel, why = load()
    if kernel is None:
        raise SystemExit(f"no kernel: {why}")
    torch.manual_seed(0)
    body = [torch.randn(n, k) / k ** 0.5 for n, k in LAYER * 30]
    head = torch.randn(*HEAD) / HEAD[1] ** 0.5
    report: dict = {"threads": torch.get_num_threads(), "body_mb": sum(w.numel() for w in body) * 4 / 1e6,
                    "head_mb": head.numel() * 4 / 1e6, "rows": {}}
    for rows in (int(r) for r in a.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        row: dict = {}
        for part, weights in (("body", body), ("head", [head])):
            pairs = [(xs[w.shape[1]], w) for w in weights]
            for name, fn in (("linear", F.linear), ("kernel", kernel)):
                row[f"{part}_{name}_ms"] = best_ms(fn, pairs, a.repeats)
            mb = report[f"{part}_mb"]
            row[f"{part}_gb_per_s"] = {n: mb / row[f"{part}_{n}_ms"] for n in ("linear", "kernel")}
            row[f"{part}_max_abs_diff"] = max((kernel(x, w) - F.linear(x, w)).abs().max().item() for x, w in pairs)
        report["rows"][rows] = row
        print(f"rows {rows:2d}: body linear {row['body_linear_ms']:6.2f} ms, kernel {row['body_kernel_ms']:6.2f} ms"
              f" | head linear {row['head_linear_ms']:5.2f} ms, kernel {row['head_kernel_ms']:5.2f} ms"
              f" | max diff {max(row['body_max_abs_diff'], row['head_max_abs_diff']):.1e}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
