"""How many admissions the fast engine's prefix cache needs on a multi-turn workload: the prefill budget
counted in new tokens (now) against whole prompts (before), on the CPU.

On the GPU (README "Where the multi-turn time goes") each admission cost 70-110 ms of the worker's host time
and the multi-turn run took 14-18 of them, because later turns were budgeted by their whole prompts although
the slots already held all but their last few dozen tokens. This runs a multi-turn workload straight against
the engine (no agent loop): `--groups` prompts x `--n` samples, `--turns` turns, each later turn its
trajectory's previous prompt + the sampled tokens + `--delta` new tokens, all of a turn's requests submitted
together, with `--prefill-tokens` as the budget; the two budgets alternate in one process, `--repeats` times.
Reports admissions, the worker's admission seconds, prefilled tokens and wall seconds per run.

    PYTHONPATH=. python benchmarks/fast_prefix/admission_probe.py [--model tiny-random] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import torch

from turnrl.bench.common import machine_info
from turnrl.engines.base import Sampling
from turnrl.engines.fast import FastEngine
from turnrl.models import prepare


def whole_prompt_budget(engine: FastEngine):
    """The admission rule before: rows x the longest whole prompt within `prefill_tokens`."""
    def fits(taken, req):
        if not engine.slots.available():
            return False
        width = max([len(r.prompt) for r in taken] + [len(req.prompt)])
        if taken and width * (len(taken) + 1) > engine.prefill_tokens:
            return False
        req.plan = engine.slots.plan(req.prompt, may_wait=not req.waited)
        if req.plan is None:
            req.waited = True
            return None
        return True
    return fits


async def workload(engine: FastEngine, a: argparse.Namespace, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)   # new prompts each run: nothing cached from an earlier run matches
    firsts = [[rng.randrange(10, vocab) for _ in range(a.prompt)] for _ in range(a.groups)]
    prompts = [p for p in firsts for _ in range(a.n)]
    before = dict(engine.stats)
    start = time.perf_counter()
    for turn in range(a.turns):
        outs = await asyncio.gather(*(engine.generate(p, Sampling(max_tokens=a.tokens, temperature=1.0,
                                                                  seed=1000 * turn + i, stop_token_ids=[]))
                                      for i, p in enumerate(prompts)))
        prompts = [p + o.token_ids + [rng.randrange(10, vocab) for _ in range(a.delta)]
                   for p, o in zip(prompts, outs)]
    wall = time.perf_counter() - start
    delta = {k: engine.stats[k] - before.get(k, 0) for k in ("admissions", "admit_s", "prefill_tokens", "requests",
                                                            "decode_steps", "busy_s", "prefix_hit_tokens",
                                                            "parked_reuses", "prefix_copies", "evicted", "deferred")}
    return {"wall_s": wall, **delta}


async def main(a: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(prepare(a.model), dtype=torch.float32)
    engine = FastEngine("", device="cpu", dtype="float32", max_batch_size=a.groups * a.n,
                        max_len=a.prompt + a.turns * (a.tokens + a.delta) + 8, gather_ms=20, model=model,
                        prefix_cache=True, prefill_tokens=a.prefill_tokens)
    new_rule = engine._fits
    old_rule = whole_prompt_budget(engine)
    vocab = model.config.vocab_size
    await engine.generate([1, 2, 3], Sampling(max_tokens=2))
    runs: dict[str, list[dict]] = {"whole_prompts": [], "new_tokens": []}
    try:
        for k in range(a.repeats):
            for j, (name, rule) in enumerate((("whole_prompts", old_rule), ("new_tokens", new_rule))):
                engine._fits = rule
                await engine.reset_prefix_cache()   # runs start alike: nothing cached
                result = await workload(engine, a, vocab, seed=2 * k + j)
                runs[name].append(result)
                print(name, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}),
                      flush=True)
    finally:
        await engine.close()
    return {"benchmark": "fast engine admissions, multi-turn, CPU", "model": a.model, "args": vars(a),
            "runs": runs, "machine": machine_info()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--delta", type=int, default=24)
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    report = asyncio.run(main(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
