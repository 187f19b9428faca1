"""Grouped-query attention under a mask on the CPU: transformers' SDPA path (KV heads copied per query head)
against `turnrl.engines.cpu_attention.masked_sdpa` (shared inside the kernel), forward and backward.

    PYTHONPATH=. python benchmarks/cpu_gqa_attention_ab.py [--repeats 7] [--json out.json]

Shapes (SmolLM2-135M: 9 query heads, 3 KV heads, head dim 64): a shared-prefix trainer's suffix lane (16 rows,
150 own tokens over a 360-token prefix) and an engine prefill of later turns (4 rows, 30 new tokens over 300
cached). Alternates the two in one process; medians in ms, and the largest output and gradient differences.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SHAPES = {"train_suffix_lane": (16, 150, 510, True), "engine_prefill": (4, 30, 330, False)}


def case(rows: int, queries: int, keys: int, grad: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    module = torch.nn.Module().train(grad)
    module.num_key_value_groups, module.is_causal = 3, True
    q = torch.randn(rows, 9, queries, 64, generator=gen).requires_grad_(grad)
    k, v = (torch.randn(rows, 3, keys, 64, generator=gen).requires_grad_(grad) for _ in range(2))
    mask = torch.ones(rows, 1, queries, keys, dtype=torch.bool).tril(keys - queries)
    mask[::2, ..., :20] = False                    # padded rows
    return module, q, k, v, mask


def run(attention, shape, grad: bool):
    module, q, k, v, mask = case(*shape[:3], grad)
    t0 = time.perf_counter()
    with torch.set_grad_enabled(grad):
        out, _ = attention(module, q, k, v, mask, scaling=0.125)
        if grad:
            out.pow(2).sum().backward()
    seconds = time.perf_counter() - t0
    return seconds, [out.detach()] + ([q.grad, k.grad, v.grad] if grad else [])


def main() -> dict:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from turnrl.engines.cpu_attention import masked_sdpa

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json")
    a = p.parse_args()
    report = {"benchmark": "cpu_gqa_attention_ab", "threads": torch.get_num_threads(), "shapes": {}}
    for name, shape in SHAPES.items():
        grad = shape[3]
        times = {"repeat_kv": [], "masked_sdpa": []}
        for _ in range(a.repeats):
            for label, fn in (("repeat_kv", sdpa_attention_forward), ("masked_sdpa", masked_sdpa)):
                times[label].append(run(fn, shape, grad)[0] * 1000)
        _, ref = run(sdpa_attention_forward, shape, grad)
        _, got = run(masked_sdpa, shape, grad)
        diffs = [float((x - y).abs().max()) for x, y in zip(got, ref)]
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        report["shapes"][name] = {"rows_queries_keys": shape[:3], "backward": grad, "median_ms": med,
                                  "all_ms": times, "max_abs_diff_out_then_grads": diffs}
        print(f"{name}: repeat_kv {med['repeat_kv']:.1f} ms, masked_sdpa {med['masked_sdpa']:.1f} ms; "
              f"max diffs {diffs}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
