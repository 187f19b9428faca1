"""How close the transformers engine's CPU decode step is to this machine's memory bandwidth.

One decode step of SmolLM2-135M in float32, as the hf engine runs it (its growing KV cache and CPU decode
attention), at `--rows` rows over `--context` cached tokens, under torch.profiler: the time of the linear
layers' products (`aten::mm`, they read every weight once a step), of the attention's products (`aten::bmm`,
they read every row's cached keys and values) and of everything else. Each product class is set against the
bytes it must read, and both against two reference reads of a 1 GiB float32 tensor on the same threads (a sum
and a copy), which bound what any kernel can stream here. `--products` also times the body's 210 products of
a step alone (30 layers of SmolLM2's seven weights, 425 MB, each read once a pass as in a decode step) at each
row count, three ways: `linear`; MKL's packed weights (`torch.ops.mkl._mkl_linear`, packed for exactly that row
count); oneDNN's (`torch.ops.mkldnn._linear_pointwise`, packed for any row count).

    PYTHONPATH=. python benchmarks/cpu_decode_profile.py --rows 8 --context 600 --json results.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def reference_gbs(repeats: int = 5) -> dict[str, float]:
    """GB/s of reading a 1 GiB float32 tensor: `sum` (read only) and `copy_` (read + write), best of `repeats`."""
    x = torch.ones(256 * 1024 * 1024)
    y = torch.empty_like(x)
    out = {}
    for name, fn, factor in (("sum", lambda: x.sum(), 1), ("copy", lambda: y.copy_(x), 2)):
        fn()
        best = min(_timed(fn) for _ in range(repeats))
        out[name] = factor * x.numel() * 4 / best / 1e9
    return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def products(rows: int, repeats: int = 5) -> dict[str, float]:
    """ms per pass over 30 layers of SmolLM2-135M's seven linear weights (random, float32) at `rows` rows."""
    h, i, kv, layers = 576, 1536, 192, 30
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]   # q k v o gate up down: (out, in)
    weights = [[torch.randn(o, n) * 0.02 for o, n in shapes] for _ in range(layers)]
    xs = {n: torch.randn(rows, n) for _, n in shapes}
    mkl = [[torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in layer] for layer in weights]
    dnn = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in weights]
    ways = {
        "linear": lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for layer in weights for w in layer],
        "mkl_packed": lambda: [torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, rows)
                               for layer, packed in zip(weights, mkl) for w, p in zip(layer, packed)],
        "onednn_packed": lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                  for layer, packed in zip(weights, dnn) for w, p in zip(layer, packed)]}
    out = {}
    for name, fn in ways.items():
        fn()
        out[name] = min(_timed(fn) for _ in range(repeats)) * 1e3
    out["weight_mb"] = sum(w.numel() * 4 for layer in weights for w in layer) / 1e6
    return out


def decode_profile(rows: int, context: int, steps: int) -> dict:
    from transformers import AutoModelForCausalLM

    from turnrl.engines.cpu_attention import use_decode_attention
    from turnrl.engines.hf import new_cache
    from turnrl.models import resolve

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(resolve("smollm2-135m-instruct")), dtype=torch.float32)
    model = model.eval().requires_grad_(False)
    use_decode_attention(model)
    cfg = model.config
    cache = new_cache(cfg)
    attn = torch.ones(rows, context, dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, cfg.vocab_size, (rows, context)), attention_mask=attn,
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        state = {"attn": attn, "last": out.logits[:, -1].argmax(-1)}

        def step() -> None:
            state["attn"] = torch.cat([state["attn"], torch.ones(rows, 1, dtype=torch.long)], 1)
            pos = state["attn"].sum(1, keepdim=True) - 1
            o = model(input_ids=state["last"].unsqueeze(1), attention_mask=state["attn"], position_ids=pos,
                      past_key_values=cache, use_cache=True)
            state["last"] = o.logits[:, -1].float().argmax(-1)

        for _ in range(3):
            step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall_ms = (time.perf_counter() - start) / steps * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
    ms = {"mm": 0.0, "bmm": 0.0}
    total = 0.0
    for e in prof.key_averages():
        total += e.self_cpu_time_total
        if e.key in ("aten::mm", "aten::bmm"):
            ms[e.key[6:]] += e.self_cpu_time_total
    ms = {k: v / steps / 1e3 for k, v in ms.items()}
    profiled = total / steps / 1e3
    weight_bytes = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "norm" not in n) * 4
    weight_bytes += cfg.vocab_size * cfg.hidden_size * 4           # the (tied) head is read each step too
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = 2 * cfg.num_hidden_layers * kv_heads * head_dim * 4 * rows * (context + 4 + steps + steps // 2)   # mid-profile
    return {"rows": rows, "context": context, "wall_ms_per_step": wall_ms, "profiled_ms_per_step": profiled,
            "linear_mm_ms": ms["mm"], "attention_bmm_ms": ms["bmm"], "other_ms": profiled - ms["mm"] - ms["bmm"],
            "weight_mb": weight_bytes / 1e6, "kv_mb": kv_bytes / 1e6,
            "linear_gbs": weight_bytes / ms["mm"] / 1e6, "attention_gbs": kv_bytes / ms["bmm"] / 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="8", help="comma-separated row counts")
    p.add_argument("--context", type=int, default=600, help="cached tokens per row before the timed steps")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--products", action="store_true", help="also time the body's products alone, three ways")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    report = {"threads": torch.get_num_threads(), "reference_gbs": reference_gbs(), "steps": []}
    print("reference read bandwidth (GB/s):", {k: round(v, 1) for k, v in report["reference_gbs"].items()})
    for rows in (int(r) for r in a.rows.split(",")):
        r = decode_profile(rows, a.context, a.steps)
        report["steps"].append(r)
        if a.products:
            r["products_ms"] = products(rows)
        print({k: round(v, 1) if isinstance(v, float) else v for k, v in r.items() if k != "products_ms"},
              flush=True)
        if a.products:
            print("  products alone (ms a pass):", {k: round(v, 1) for k, v in r["products_ms"].items()}, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
