"""Probe: which matmul shapes give per-element results independent of the batch around them (CPU or CUDA).

Run: python benchmarks/exact_probe.py [cpu|cuda]. Prints one JSON line per check (true = invariant)."""
import json
import sys

import torch

dev = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
out = {}


def lin_checks(dtype, T, K=896, N=4864):
    W = torch.randn(N, K, device=dev).to(dtype)
    x = torch.randn(4 * T, K, device=dev).to(dtype)
    ref = torch.nn.functional.linear(x[:T], W)
    rowpos = all(torch.equal(torch.nn.functional.linear(torch.cat([x[3 * T:3 * T + s], x[:T - s]]), W)[s:], ref[:T - s])
                 for s in (1, 5, T // 2))
    bigm = torch.equal(torch.nn.functional.linear(x, W)[:T], ref)
    chunks = torch.cat([torch.nn.functional.linear(c, W) for c in x.split(T)])
    return {"rowpos": rowpos, "M4T_vs_tile": bigm, "tiles_equal_full": torch.equal(chunks, torch.nn.functional.linear(x, W))}


for dtype in (torch.float32, torch.bfloat16):
    for T in (16, 64, 128, 256):
        out[f"linear {dtype} T={T}"] = lin_checks(dtype, T)


def bmm_checks(dtype, M, K, N):
    a = torch.randn(64, M, K, device=dev).to(dtype)
    b = torch.randn(64, K, N, device=dev).to(dtype)
    full = torch.matmul(a, b)
    one = torch.matmul(a[:1], b[:1])
    few = torch.matmul(a[:7], b[:7])
    rowpos = torch.equal(torch.matmul(torch.cat([a[:, 3:], a[:, :3]], 1), b)[:, M - 3:], full[:, :3])
    return {"batch1": torch.equal(one, full[:1]), "batch7": torch.equal(few, full[:7]), "rowpos": rowpos}


for dtype in (torch.float32, torch.bfloat16):
    out[f"scores tile {dtype} 16x64x64"] = bmm_checks(dtype, 16, 64, 64)
    out[f"scores tile {dtype} 16x64x128"] = bmm_checks(dtype, 16, 64, 128)
    out[f"pv tile {dtype} 16x64x64"] = bmm_checks(dtype, 16, 64, 64)
    out[f"pv tile {dtype} 16x128x64"] = bmm_checks(dtype, 16, 128, 64)
    out[f"pv tile {dtype} 64x128x64"] = bmm_checks(dtype, 64, 128, 64)
for k, v in out.items():
    print(json.dumps({"device": dev, "check": k, **v}))
