"""Host and device time of the prefill attention for shapes seen once (as an admission of new sizes sees them):
SDPA left to choose its backend (with grouped heads and an additive mask) against `masked_attention` (the
memory-efficient kernel named directly, keys and values repeated per head), Qwen2.5-0.5B's heads (14 query, 2 key/
value, head_dim 64), bf16, 24 calls a shape (one per layer).

    python benchmarks/fast_prefix/sdpa_probe.py --json OUT.json      (CUDA only)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from turnrl.engines.fast.decoder import additive_mask, masked_attention

HEADS, KV, DIM, LAYERS = 14, 2, 64, 24
SHAPES = [(256, 32, 256), (256, 48, 384), (96, 192, 256), (64, 256, 256), (200, 40, 300), (128, 64, 512),
          (32, 128, 640), (250, 44, 420)]   # (rows, new tokens, context): later turns and first prompts


def run(kind: str, n: int, width: int, total: int) -> dict[str, float]:
    dev, dtype = "cuda", torch.bfloat16
    q = torch.randn(n, HEADS, width, DIM, device=dev, dtype=dtype)
    k, v = (torch.randn(n, KV, total, DIM, device=dev, dtype=dtype) for _ in range(2))
    positions = (total - width + torch.arange(width, device=dev))[None].expand(n, width)
    bias = additive_mask(positions, total, dtype)
    torch.cuda.synchronize()
    start, first = time.perf_counter(), None
    for layer in range(LAYERS):
        if kind == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=DIM ** -0.5, enable_gqa=True)
        else:
            out = masked_attention(q, k, v, bias, DIM ** -0.5)
        if layer == 0:
            first = time.perf_counter() - start
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    total_s = time.perf_counter() - start
    return {"first_call_host_ms": first * 1e3, "host_ms": host * 1e3, "with_device_ms": total_s * 1e3,
            "out_sum": float(out.float().abs().sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    for kind in ("sdpa", "efficient"):
        for n, width, total in SHAPES:
            row = {"kind": kind, "rows": n, "width": width, "context": total, **run(kind, n, width, total)}
            row["again"] = run(kind, n, width, total)     # the same shape a second time
            results.append(row)
            print(f"{kind:>9} {n:>4} x {width:>4} over {total:>4}: first shape host {row['host_ms']:7.2f} ms "
                  f"(first call {row['first_call_host_ms']:6.2f}), with device {row['with_device_ms']:7.2f} ms | "
                  f"again host {row['again']['host_ms']:6.2f} ms, with device {row['again']['with_device_ms']:6.2f} ms")
    summary = {kind: {key: statistics.median(r[key] if key != "again" else r["again"]["with_device_ms"]
                                             for r in results if r["kind"] == kind)
                      for key in ("host_ms", "with_device_ms", "again")} for kind in ("sdpa", "efficient")}
    print("medians (ms, 24 calls):", json.dumps(summary))
    # the two agree (same inputs, other kernels): compare one shape's outputs
    n, width, total = SHAPES[0]
    q = torch.randn(n, HEADS, width, DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(n, KV, total, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bias = additive_mask((total - width + torch.arange(width, device="cuda"))[None].expand(n, width), total,
                         torch.bfloat16)
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=DIM ** -0.5, enable_gqa=True)
    b = masked_attention(q, k, v, bias, DIM ** -0.5)
    diff = (a.float() - b.float()).abs().max().item()
    print(f"max |sdpa - efficient| {diff:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results,
                       "summary": summary, "max_abs_diff": diff}, f, indent=1)


if __name__ == "__main__":
    main()
