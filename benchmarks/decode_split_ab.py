"""The fast engine's decode step with other blockings of its attention kernel, inside the real step.

`benchmarks/decode_attention_probe.py` picked the kernel's blocking in isolation, replaying one layer's call
20 times over the same keys and values, so part of them came from the L2 cache. In a decode step each layer's
cache is read once, cold. This runs `turnrl bench engine`'s `fast-compile` variant once per blocking and
reports the step times. A blocking is SPLIT_KEYS[:BLOCK_N[:WARPS[:STAGES]]] (positions of the bucket per
split: fewer mean more programs with shorter loops; keys per inner step; warps; pipeline stages), the
kernel's defaults where left out.

    python benchmarks/decode_split_ab.py --split-keys 128,256,512 --out results.json     (CUDA)
    python benchmarks/decode_split_ab.py --split-keys 512:64:4:3,512:128:4:3,256:64:4:2 --out results.json
"""

from __future__ import annotations

import argparse
import json

from turnrl.bench.engine import bench_engine
from turnrl.engines.fast import attention_kernel

FIELDS = ("SPLIT_KEYS", "BLOCK_N", "WARPS", "STAGES")


def blocking(text: str) -> dict[str, int]:
    values = [int(x) for x in text.split(":")]
    if not 1 <= len(values) <= len(FIELDS):
        raise SystemExit(f"blocking {text!r}: give SPLIT_KEYS[:BLOCK_N[:WARPS[:STAGES]]], e.g. 512:64:4:3")
    defaults = {name: getattr(attention_kernel, name) for name in FIELDS}
    return {**defaults, **dict(zip(FIELDS, values))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split-keys", default="128,256,512", help="comma-separated blockings (see above)")
    parser.add_argument("--model", default="qwen2.5-0.5b-shape")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    blockings = [blocking(x) for x in args.split_keys.split(",")]
    rows, report = [], {}
    for chosen in blockings:
        for name, value in chosen.items():
            setattr(attention_kernel, name, value)
        report = bench_engine(args.model, args.batch, args.prompt, args.new, ["fast-compile"], device="cuda")
        result = report["variants"]["fast-compile"]
        step = result.get("step", {})
        rows.append({"split_keys": chosen["SPLIT_KEYS"], "blocking": chosen, "tokens_per_s": result.get("tokens_per_s"),
                     "step_ms": step.get("step_ms"), "layers_ms": step.get("layers_ms"),
                     "decode_tokens_per_s": result.get("decode_tokens_per_s"),
                     "fraction_of_bound_decode": (report["bound"]["memory_ms_per_step_measured"] / step["step_ms"]
                                                  if step.get("step_ms") else None),
                     "error": result.get("error"), "top_kernels": step.get("top_kernels", [])[:8]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "top_kernels"}), flush=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "decode_split_ab", "model": args.model, "batch": args.batch, "prompt": args.prompt,
                   "new": args.new, "rows": rows, "bound": report.get("bound"), "machine": report.get("machine")},
                  f, indent=1)


if __name__ == "__main__":
    main()
