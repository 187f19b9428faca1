"""The transformers engine's lean CPU decode step (turnrl/engines/cpu_decode.py) against the model's forward.

SmolLM2-135M in float32: `LeanDecode` (the same operations as transformers' forward, without its modules, the
4-D mask building and the views) and the model's own forward, each from the same prefilled cache state,
alternating, at `--rows` rows over ~600 cached tokens; ms per decode step and the largest difference of the
first step's logits (0: bit for bit). `--kernel` adds `LeanDecode` with its weight products through the skinny
kernel (turnrl/engines/cpu_gemm.py), as the engine runs it on an AVX-512 CPU.

    PYTHONPATH=. python benchmarks/cpu_lean_decode_probe.py --rows 1,8,16 [--kernel] --json results.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from turnrl.engines.cpu_decode import LeanDecode


def load():
    from transformers import AutoModelForCausalLM

    from turnrl.engines.cpu_attention import use_decode_attention
    from turnrl.models import resolve
    model = AutoModelForCausalLM.from_pretrained(str(resolve("smollm2-135m-instruct")), dtype=torch.float32)
    model = model.eval().requires_grad_(False)
    use_decode_attention(model)
    return model


def prefilled(model, prompt: torch.Tensor, attn: torch.Tensor):
    from turnrl.engines.hf import new_cache
    cache = new_cache(model.config)
    out = model(input_ids=prompt, attention_mask=attn, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1].argmax(-1)


def run(model, rows: int, lean, steps: int, context: int = 600) -> tuple[float, torch.Tensor]:
    """Median ms of `steps` decode steps (after 3) from the same seeded prompt; the first step's logits."""
    g = torch.Generator().manual_seed(rows)
    prompt = torch.randint(0, model.config.vocab_size, (rows, context), generator=g)
    attn = torch.ones(rows, context, dtype=torch.long)
    attn[0, :5] = 0                       # one left-padded row, as in the engine's batches
    times, first = [], None
    step = lean if callable(lean) else LeanDecode(model)
    with torch.no_grad():
        cache, last = prefilled(model, prompt, attn)
        for _ in range(steps + 3):
            attn = torch.cat([attn, torch.ones(rows, 1, dtype=torch.long)], 1)
            pos = attn.sum(1, keepdim=True) - 1
            start = time.perf_counter()
            if lean:
                logits = step(last, pos[:, 0], attn, cache)
            else:
                logits = model(input_ids=last.unsqueeze(1), attention_mask=attn, position_ids=pos,
                               past_key_values=cache, use_cache=True).logits[:, -1]
            times.append(time.perf_counter() - start)
            first = logits if first is None else first
            last = logits.argmax(-1)
    return sorted(times[3:])[len(times[3:]) // 2] * 1e3, first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2, help="alternations of the forwards per row count")
    p.add_argument("--kernel", action="store_true", help="also the lean step through the skinny kernel")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    model = load()
    variants = {"transformers": False, "lean": True}
    if a.kernel:
        from turnrl.engines.cpu_gemm import load as load_kernel
        kernel, why = load_kernel()
        if kernel is None:
            raise SystemExit(f"--kernel: {why}")
        variants["lean+kernel"] = LeanDecode(model, kernel)
    report = {"model": "smollm2-135m-instruct", "dtype": "float32", "threads": torch.get_num_threads(), "rows": {}}
    for rows in (int(r) for r in a.rows.split(",")):
        ms: dict = {name: [] for name in variants}
        diff: dict = {}
        for _ in range(a.repeats):
            for name, lean in variants.items():
                t, logits = run(model, rows, lean, a.steps)
                ms[name].append(t)
                if lean is False:
                    reference = logits
                else:
                    diff[name] = (logits - reference).abs().max().item()
        report["rows"][rows] = {"ms_per_step": ms, "max_logit_diff": diff}
        print(rows, {k: [round(x, 1) for x in v] for k, v in ms.items()},
              "max logit diff " + ", ".join(f"{k} {v:.2e}" for k, v in diff.items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
