"""A/B of the hf engine's CPU LM head (`turnrl.engines.cpu_head`): decode throughput with W @ x^T for small
decode batches against plain `linear`, on SmolLM2-135M in float32, alternating the two in one process.

    PYTHONPATH=. python benchmarks/cpu_head_ab.py --rows 4,8,16 --json results.json

For each row count: that many chat prompts, 96 sampled tokens each (temperature 1, seeded), generated together;
tokens/s per run, and whether the two sampled the same tokens (and their largest logprob gap where they did).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import turnrl.engines.hf as hf
from turnrl.engines.base import Sampling
from turnrl.models import resolve


async def run(path: str, prompts: list[list[int]], skinny: bool, new: int):
    keep = hf.use_skinny_head
    if not skinny:
        hf.use_skinny_head = lambda model: False
    try:
        engine = hf.HFEngine(path, device="cpu", dtype="float32", seed=0)
    finally:
        hf.use_skinny_head = keep
    await engine.generate(prompts[0], Sampling(max_tokens=4))
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, Sampling(max_tokens=new, temperature=1.0, seed=i))
                                  for i, p in enumerate(prompts)))
    seconds = time.perf_counter() - start
    await engine.close()
    return sum(len(o.token_ids) for o in outs) / seconds, outs


async def main(a: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer
    path = str(resolve("smollm2-135m-instruct"))
    tok = AutoTokenizer.from_pretrained(path)
    report = {"model": "smollm2-135m-instruct", "dtype": "float32", "new_tokens": a.new, "rows": {}}
    for rows in [int(r) for r in a.rows.split(",")]:
        prompts = [tok.apply_chat_template([{"role": "user", "content": f"Question {i}: what is {i} * {i + 3}?"}],
                                           add_generation_prompt=True, tokenize=True) for i in range(rows)]
        prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
        runs: dict[str, list[float]] = {"linear": [], "skinny": []}
        outs = {}
        for k in range(a.repeats):
            for skinny in (False, True):
                rate, outs[skinny] = await run(path, prompts, skinny, a.new)
                runs["skinny" if skinny else "linear"].append(rate)
        same = [x.token_ids == y.token_ids for x, y in zip(outs[False], outs[True])]
        gaps = [abs(p - q) for s, x, y in zip(same, outs[False], outs[True]) if s for p, q in zip(x.logprobs, y.logprobs)]
        report["rows"][rows] = {"tokens_per_s": runs, "same_tokens": sum(same), "max_logprob_gap": max(gaps, default=None)}
        print(rows, json.dumps(report["rows"][rows]), flush=True)
    return report


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="4,8,16")
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    result = asyncio.run(main(args))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
