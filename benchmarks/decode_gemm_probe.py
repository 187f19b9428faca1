"""The fast engine's decode-step weight products at 64-256 rows on one GPU: cuBLAS (what the step runs now),
cuBLASLt, a split-K Triton kernel over a grid of blockings and, with --autotune, inductor's max-autotune.

    python benchmarks/decode_gemm_probe.py [--rows 64,128,256] [--autotune] --json out.json

Shapes: Qwen2.5-0.5B's layer (hidden 896, intermediate 4864, 14 + 2 + 2 heads of 64), bf16, y = x @ W.T with W
as nn.Linear stores it ([N, K]). The split-K kernel writes float32 partial sums [splits, M, N]; `ms` counts
the kernel and the sum over the splits with the cast to bf16 (in the step inductor would fuse that sum into
the residual add that follows), `kernel_ms` the kernel alone. Times are per call, 20 calls captured in one
CUDA graph, the median of the replays. `bound_ms` is the larger of the weight bytes at 3.0 TB/s (H100's
measured copy rate) and the FLOPs at 790 TFLOP/s.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from turnrl.bench.common import graph_ms

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}


@triton.jit
def _splitk(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k0 = pid_s * k_per_split
    k1 = tl.minimum(k0 + k_per_split, K)
    xp = x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :]
    wp = w_ptr + rn[None, :] * stride_wn + (k0 + rk)[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(k0, k1, BK):
        a = tl.load(xp, mask=rm[:, None] < M, other=0.0)
        b = tl.load(wp, mask=rn[None, :] < N, other=0.0)
        acc = tl.dot(a, b, acc)
        xp += BK
        wp += BK
    out = out_ptr + pid_s * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def splitk(x: torch.Tensor, w: torch.Tensor, cfg: dict, out: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    bm, bn, bk, splits = cfg["BM"], cfg["BN"], cfg["BK"], cfg["splits"]
    per = -(-k // bk // splits) * bk
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), triton.cdiv(k, per))
    _splitk[grid](x, w, out, m, n, k, per, x.stride(0), w.stride(0), BM=bm, BN=bn, BK=bk,
                  num_warps=cfg["warps"], num_stages=cfg["stages"])
    return out


def timed(fn, repeats: int = 30, calls: int = 20) -> float:
    """ms per call: `calls` calls in one CUDA graph (host launch time not counted), the median of the replays."""
    return graph_ms(fn, repeats, calls, warmup=3)


def configs(m: int):
    for bm, bn, bk, splits, warps, stages in itertools.product((64, 128, 256), (32, 64, 128), (64, 128),
                                                               (1, 2, 4, 8), (4, 8), (3, 4)):
        if bm > max(64, m) or (bm == 256 and warps == 4):
            continue
        if stages * (bm + bn) * bk * 2 > 200_000:
            continue
        yield {"BM": bm, "BN": bn, "BK": bk, "splits": splits, "warps": warps, "stages": stages}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="64,128,256")
    parser.add_argument("--autotune", action="store_true", help="inductor max-autotune at 256 rows too")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "rows": []}
    for m, (name, (n, k)) in itertools.product([int(r) for r in args.rows.split(",")], SHAPES.items()):
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
        want = x.float() @ w.float().T
        scale = want.abs().max().item()
        bound = max(n * k * 2 / 3.0e12, 2 * m * n * k / 790e12) * 1e3
        row = {"rows": m, "shape": name, "n": n, "k": k, "bound_ms": bound}
        row["cublas_ms"] = timed(lambda: F.linear(x, w))
        torch.backends.cuda.preferred_blas_library("cublaslt")
        row["cublaslt_ms"] = timed(lambda: F.linear(x, w))
        torch.backends.cuda.preferred_blas_library("cublas")
        results, t0 = [], time.perf_counter()
        for cfg in configs(m):
            per = -(-k // cfg["BK"] // cfg["splits"]) * cfg["BK"]
            if k % cfg["BK"] or (cfg["splits"] > 1 and per * (cfg["splits"] - 1) >= k):
                continue
            parts = torch.empty(-(-k // per), m, n, device="cuda",
                                dtype=torch.float32 if cfg["splits"] > 1 else torch.bfloat16)
            try:
                got = splitk(x, w, cfg, parts).float().sum(0)
            except Exception as exc:  # noqa: BLE001 - out of shared memory or registers: skip the blocking
                results.append({**cfg, "error": type(exc).__name__})
                continue
            err = (got - want).abs().max().item() / scale
            kernel = timed(lambda: splitk(x, w, cfg, parts))
            total = kernel if cfg["splits"] == 1 else timed(lambda: splitk(x, w, cfg, parts).sum(0, dtype=torch.float32)
                                                             .to(torch.bfloat16))
            results.append({**cfg, "kernel_ms": kernel, "ms": total, "rel_err": err})
        ok = sorted((r for r in results if "ms" in r), key=lambda r: r["ms"])
        row["triton_best"] = ok[:3]
        row["triton_configs"] = len(ok)
        row["triton_sweep_s"] = time.perf_counter() - t0
        if args.autotune and m == 256:
            fn = torch.compile(lambda a: F.linear(a, w), mode="max-autotune-no-cudagraphs", dynamic=False)
            t0 = time.perf_counter()
            fn(x)
            row["autotune_compile_s"] = time.perf_counter() - t0
            row["autotune_ms"] = timed(lambda: fn(x))
        best = ok[0] if ok else {"ms": float("nan"), "kernel_ms": float("nan"), "rel_err": float("nan")}
        blocking = {k: v for k, v in best.items() if k in ("BM", "BN", "BK", "splits", "warps", "stages")}
        print(f"{m:4d} {name:8s} bound {bound * 1e3:6.1f} us  cublas {row['cublas_ms'] * 1e3:6.1f}  "
              f"cublaslt {row['cublaslt_ms'] * 1e3:6.1f}  autotune {row.get('autotune_ms', float('nan')) * 1e3:6.1f}"
              f"  triton {best['ms'] * 1e3:6.1f} (kernel {best['kernel_ms'] * 1e3:6.1f} {blocking} "
              f"err {best['rel_err']:.1e})", flush=True)
        report["rows"].append(row)
        if args.json:   # after every shape: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    per_layer = {}
    for row in report["rows"]:
        agg = per_layer.setdefault(row["rows"], {"cublas_us": 0.0, "best_us": 0.0, "bound_us": 0.0})
        agg["cublas_us"] += row["cublas_ms"] * 1e3
        agg["bound_us"] += row["bound_ms"] * 1e3
        options = [row["cublas_ms"], row["cublaslt_ms"]] + [r["ms"] for r in row["triton_best"][:1]]
        agg["best_us"] += min(options) * 1e3
    report["per_layer"] = per_layer
    print(json.dumps(per_layer, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
