"""The fast engine's split-key decode attention (turnrl/engines/fast/attention_kernel.py) against the torch
path on one GPU, over blockings: keys per inner step, keys per split, warps, pipeline stages.

    python benchmarks/decode_attention_probe.py [--batch 256] [--n-kv 512] --json out.json

Shape: Qwen2.5-0.5B's attention (14 query heads over 2 key/value heads, head size 64), bf16; each row's
position drawn from [n_kv / 2, n_kv), as in `turnrl bench engine --prompt 256 --new 256`. Times are per call,
20 calls captured in one CUDA graph, the median of 50 replays; bytes are the live keys and values each row reads.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from turnrl.bench.common import graph_ms
from turnrl.engines.fast import attention_kernel
from turnrl.engines.fast.decoder import decode_attention


def timed(fn, repeats: int = 50, calls: int = 20) -> float:
    """ms per call: `calls` calls in one CUDA graph (host launch time not counted), the median of the replays."""
    return graph_ms(fn, repeats, calls, warmup=3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--n-kv", type=int, default=512)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    b, heads, kv, dim, n_kv = args.batch, 14, 2, 64, args.n_kv
    g = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(b, kv, 2048, dim, device="cuda", generator=g).to(torch.bfloat16)
    values = torch.randn_like(keys)
    q = torch.randn(b, heads, dim, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.randint(n_kv // 2, n_kv, (b,), device="cuda", generator=g)
    live_bytes = int((pos + 1).sum()) * kv * dim * 2 * 2
    want = decode_attention(q, keys, values, pos, n_kv, 0.125)
    rows = [{"variant": "torch", "ms": timed(lambda: decode_attention(q, keys, values, pos, n_kv, 0.125))}]
    for block_n, split_keys, warps, stages in itertools.product((32, 64, 128), (64, 128, 256, 512), (2, 4, 8),
                                                                (1, 2, 3)):
        if split_keys < block_n:
            continue
        def call():
            return attention_kernel.decode_attention(q, keys, values, pos, n_kv, 0.125, block_n=block_n,
                                                     split_keys=split_keys, warps=warps, stages=stages)
        try:
            error = (call().float() - want.float()).abs().max().item()
            rows.append({"variant": "kernel", "block_n": block_n, "split_keys": split_keys, "warps": warps,
                         "stages": stages, "ms": timed(call), "max_abs_error": error})
        except Exception as exc:  # noqa: BLE001 - a blocking that does not compile is a row too
            rows.append({"variant": "kernel", "block_n": block_n, "split_keys": split_keys, "warps": warps,
                         "stages": stages, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    for row in rows:
        if "ms" in row:
            row["live_tb_per_s"] = live_bytes / row["ms"] / 1e9
    best = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    for row in [rows[0]] + best[:12]:
        print(json.dumps(row))
    result = {"device": torch.cuda.get_device_name(), "batch": b, "n_kv": n_kv, "live_bytes": live_bytes,
              "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
