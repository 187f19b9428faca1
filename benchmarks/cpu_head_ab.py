"""The hf engine's CPU LM head (`turnrl.engines.cpu_head`) on SmolLM2-135M in float32, two ways.

    PYTHONPATH=. python benchmarks/cpu_head_ab.py --rows 2,4,8,12 --json results.json      # end to end
    PYTHONPATH=. python benchmarks/cpu_head_ab.py --sweep --json results.json              # the head alone

End to end: for each row count, that many chat prompts, 96 sampled tokens each (temperature 1, seeded),
generated together, alternating an engine with the padded head and one with plain `linear` in one process;
tokens/s per run, and whether the two sampled the same tokens (and their largest logprob gap where they did).
`--sweep`: the head's product alone for 1-16 and more rows, timed right after the body's weights were
streamed (as in a decode step, so the head is not in the caches): `linear` at M rows, `linear` on the rows
padded to 16, and W @ x^T (an earlier version's path); medians over `--repeats` rounds, in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

import turnrl.engines.hf as hf
from turnrl.engines.base import Sampling
from turnrl.models import resolve

SWEEP_ROWS = list(range(1, 17)) + [20, 24, 32, 48, 64]


async def run(path: str, prompts: list[list[int]], padded: bool, new: int):
    keep = hf.use_cpu_head
    if not padded:
        hf.use_cpu_head = lambda model: False
    try:
        engine = hf.HFEngine(path, device="cpu", dtype="float32", seed=0)
    finally:
        hf.use_cpu_head = keep
    await engine.generate(prompts[0], Sampling(max_tokens=4))
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, Sampling(max_tokens=new, temperature=1.0, seed=i))
                                  for i, p in enumerate(prompts)))
    seconds = time.perf_counter() - start
    await engine.close()
    return sum(len(o.token_ids) for o in outs) / seconds, outs


async def end_to_end(a: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer
    path = str(resolve("smollm2-135m-instruct"))
    tok = AutoTokenizer.from_pretrained(path)
    report = {"model": "smollm2-135m-instruct", "dtype": "float32", "new_tokens": a.new, "rows": {}}
    for rows in [int(r) for r in a.rows.split(",")]:
        prompts = [tok.apply_chat_template([{"role": "user", "content": f"Question {i}: what is {i} * {i + 3}?"}],
                                           add_generation_prompt=True, tokenize=True) for i in range(rows)]
        prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
        runs: dict[str, list[float]] = {"linear": [], "padded": []}
        outs = {}
        for _ in range(a.repeats):
            for padded in (False, True):
                rate, outs[padded] = await run(path, prompts, padded, a.new)
                runs["padded" if padded else "linear"].append(rate)
        same = [x.token_ids == y.token_ids for x, y in zip(outs[False], outs[True])]
        gaps = [abs(p - q) for s, x, y in zip(same, outs[False], outs[True]) if s for p, q in zip(x.logprobs, y.logprobs)]
        report["rows"][rows] = {"tokens_per_s": runs, "same_tokens": sum(same), "max_logprob_gap": max(gaps, default=None)}
        print(rows, json.dumps(report["rows"][rows]), flush=True)
    return report


def sweep(a: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM
    torch.set_grad_enabled(False)
    model = AutoModelForCausalLM.from_pretrained(resolve("smollm2-135m-instruct"), dtype=torch.float32)
    body = [p for p in model.model.layers.parameters() if p.dim() == 2]
    head = model.lm_head.weight
    ways = {"linear": lambda x: torch.nn.functional.linear(x, head),
            "padded_to_16": lambda x: torch.nn.functional.linear(
                torch.cat([x, x.new_zeros(max(16 - len(x), 0), x.shape[1])]), head)[:len(x)],
            "w_xt": lambda x: torch.mm(head, x.T).T.contiguous()}
    times: dict[str, dict[int, list[float]]] = {way: {m: [] for m in SWEEP_ROWS} for way in ways}
    for _ in range(a.repeats):
        for rows in SWEEP_ROWS:
            x = torch.randn(rows, head.shape[1])
            inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in body}
            for way, fn in ways.items():
                for w in body:   # stream the body's weights first, as a decode step does
                    torch.nn.functional.linear(inputs[w.shape[1]], w)
                start = time.perf_counter()
                fn(x)
                times[way][rows].append((time.perf_counter() - start) * 1e3)
    report = {"model": "smollm2-135m-instruct", "dtype": "float32", "threads": torch.get_num_threads(),
              "what": "ms of the head's product after the body's weights were streamed, median over repeats",
              "ms": {way: {m: statistics.median(v) for m, v in by.items()} for way, by in times.items()}}
    for rows in SWEEP_ROWS:
        print(rows, "  ".join(f"{way} {report['ms'][way][rows]:.2f}" for way in ways), flush=True)
    return report


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="2,4,8,12")
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="time the head's product alone for 1-64 rows")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    result = sweep(args) if args.sweep else asyncio.run(end_to_end(args))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
