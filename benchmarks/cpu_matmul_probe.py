"""The body's matrix products of a CPU decode step (SmolLM2-135M shapes, float32), computed several ways.

    PYTHONPATH=. python benchmarks/cpu_matmul_probe.py --json results.json

For M = 4, 8, 16 rows and each projection shape, 30 distinct weights (one a layer, so none stays in the caches):
`linear` (what transformers runs), `x @ W^T` over a contiguous transposed copy, W @ x^T, and MKL's packed
weights (`torch.ops.mkl._mkl_linear`, packed for exactly M rows); plus q/k/v and gate/up stacked into one
weight against the separate products. ms per product, best of `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SHAPES = {"q_proj/o_proj": (576, 576), "k_proj/v_proj": (192, 576), "gate_proj/up_proj": (1536, 576),
          "down_proj": (576, 1536), "qkv stacked": (960, 576), "gate_up stacked": (3072, 576)}


def best_ms(fn, weights, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            fn(w)
        times.append((time.perf_counter() - start) / len(weights) * 1e3)
    return min(times)


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    report: dict = {"threads": torch.get_num_threads(), "ms": {}}
    for name, (out, inp) in SHAPES.items():
        weights = [torch.randn(out, inp) for _ in range(30)]
        transposed = {id(w): w.t().contiguous() for w in weights}
        for rows in (4, 8, 16):
            x = torch.randn(rows, inp)
            packed = {id(w): torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights} \
                if torch._C.has_mkl else {}
            ways = {"linear": lambda w: torch.nn.functional.linear(x, w),
                    "x @ W^T copy": lambda w: torch.mm(x, transposed[id(w)]),
                    "W @ x^T": lambda w: torch.mm(w, x.T).T.contiguous()}
            if packed:
                ways["mkl packed"] = lambda w: torch.ops.mkl._mkl_linear(x, packed[id(w)], w, None, rows)
            row = {way: best_ms(fn, weights, a.repeats) for way, fn in ways.items()}
            report["ms"].setdefault(name, {})[rows] = row
            print(f"{name:18s} M={rows:2d} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    for rows in (4, 8, 16):
        ms = {k: v[rows]["linear"] for k, v in report["ms"].items()}
        report.setdefault("stacked_against_separate", {})[rows] = {
            "qkv": [ms["qkv stacked"], 2 * ms["k_proj/v_proj"] + ms["q_proj/o_proj"]],
            "gate_up": [ms["gate_up stacked"], 2 * ms["gate_proj/up_proj"]]}
    print(json.dumps(report["stacked_against_separate"]))
    with open(a.json, "w") as f:
        json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
