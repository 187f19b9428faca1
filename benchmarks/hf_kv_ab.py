"""A/B of the hf engine's KV cache on a CPU (`turnrl.engines.growing_cache`): layers that append in place
against transformers' `DynamicLayer` (a `torch.cat` of the whole cache every decode step), alternating the two
in one process, on SmolLM2-135M in float32.

    PYTHONPATH=. python benchmarks/hf_kv_ab.py --rows 8,16 --json results.json

For each row count: that many ~240-token chat prompts, `--new` sampled tokens each with no stop token (temperature
1, seeded), generated together; seconds, decode steps and ms per step for each run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import turnrl.engines.hf as hf
from turnrl.engines.base import Sampling
from turnrl.models import resolve


async def run(path: str, prompts: list[list[int]], growing: bool, new: int, seed: int) -> dict:
    keep = hf.grow_in_place
    if not growing:
        hf.grow_in_place = lambda cache: cache
    try:
        engine = hf.HFEngine(path, device="cpu", dtype="float32", seed=0)
        await engine.generate(prompts[0], Sampling(max_tokens=4))
        before = dict(engine.stats)
        start = time.perf_counter()
        await asyncio.gather(*(engine.generate(p, Sampling(max_tokens=new, temperature=1.0, seed=seed + i,
                                                           stop_token_ids=[])) for i, p in enumerate(prompts)))
        seconds = time.perf_counter() - start
        await engine.close()
    finally:
        hf.grow_in_place = keep
    steps = engine.stats["decode_steps"] - before["decode_steps"]
    return {"s": seconds, "decode_steps": steps, "ms_per_step": seconds / steps * 1e3,
            "tokens_per_s": len(prompts) * new / seconds}


async def main(a: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer
    path = str(resolve("smollm2-135m-instruct"))
    tok = AutoTokenizer.from_pretrained(path)
    system = "You are a careful calculator assistant. " * 30
    report = {"model": "smollm2-135m-instruct", "dtype": "float32", "new_tokens": a.new, "rows": {}}
    for rows in [int(r) for r in a.rows.split(",")]:
        prompts = [tok.apply_chat_template([{"role": "system", "content": system},
                                            {"role": "user", "content": f"Question {i}: what is {i} * {i + 3} + 17?"}],
                                           add_generation_prompt=True, tokenize=True) for i in range(rows)]
        prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
        runs: dict[str, list[dict]] = {"concatenating": [], "growing": []}
        for k in range(a.repeats):
            for growing in (False, True):
                runs["growing" if growing else "concatenating"].append(await run(path, prompts, growing, a.new, 100 * k))
        report["rows"][rows] = {"prompt_tokens": len(prompts[0]), "runs": runs}
        print(rows, {name: [round(r["ms_per_step"], 1) for r in rs] for name, rs in runs.items()}, flush=True)
    return report


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,16")
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    result = asyncio.run(main(args))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
