"""The agent loop's own host cost per turn on the multi-turn workload of run_gpu.sh, without a GPU.

On the GPU the multi-turn phase of `turnrl bench rollout` loses throughput where the engine waits for the
host: the loop's turn work (detokenizing, parsing, the simulated user, the chat delta, the ledger) competes
for the GIL with the engine's worker thread. This runs the same workload (guess_number, 64 prompts x n 4, 4
policy turns of 64 tokens, the SmolLM2 tokenizer and template) through the real agent loop against an engine
that answers at once with random tokens, so the wall time is the loop's own work. It reports the loop's CPU
per policy turn and, with --profile, cProfile's top functions by own time.

    python benchmarks/fast_prefix/loop_probe.py [--repeats 3] [--profile 25] [--out loop_probe.json]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import random
import time

from turnrl.bench.common import machine_info
from turnrl.config import load_config
from turnrl.data import load_dataset
from turnrl.engines.base import Completion, EngineBase, Sampling
from turnrl.models import resolve
from turnrl.rollout.factory import build_environment, build_loop, load_template
from turnrl.rollout.scheduler import run_batch


class InstantEngine(EngineBase):
    """Answers every request at once with `max_tokens` random ids of the vocabulary (none special), the way a
    random-init model on the GPU answers: no stop token, so every turn runs to its limit."""

    def __init__(self, vocab: int, seed: int = 0):
        self.random = random.Random(seed)
        self.vocab = vocab
        self.stats = {"requests": 0}

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        self.stats["requests"] += 1
        ids = [self.random.randrange(1000, self.vocab) for _ in range(sampling.max_tokens)]
        return Completion(ids, [-1.0] * len(ids), "length", 0)


async def one_repeat(cfg, tasks, template, env, seed: int) -> dict:
    engine = InstantEngine(len(template.tokenizer) if hasattr(template, "tokenizer") else 49152, seed)
    loop = build_loop(cfg.rollout, engine, template, env, seed)
    start, cpu = time.perf_counter(), time.thread_time()
    trajs = await run_batch(loop, tasks, cfg.rollout.n, cfg.rollout.concurrency)
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
    turns = sum(len(t.turns) for t in trajs)
    return {"wall_s": wall, "loop_cpu_s": cpu, "policy_turns": turns, "requests": engine.stats["requests"],
            "loop_cpu_ms_per_turn": 1e3 * cpu / turns, "errors": sum(len(t.errors) for t in trajs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0, help="show this many functions of a profiled repeat")
    parser.add_argument("--out", default="")
    parser.add_argument("overrides", nargs="*", help="config overrides (model.name=DIR: its tokenizer, template)")
    args = parser.parse_args()
    cfg = load_config(None, ["model.name=smollm2-135m-instruct", "rollout.n=4", "rollout.concurrency=256",
                             "rollout.max_assistant_turns=4", "rollout.max_user_turns=4",
                             "rollout.sampling.max_tokens_per_turn=64"] + args.overrides)
    tasks = load_dataset(task="guess_number", size=64, seed=cfg.seed, options={})
    template = load_template(resolve(cfg.model.name))
    env = build_environment(cfg.rollout)
    runs = [asyncio.run(one_repeat(cfg, tasks, template, env, r)) for r in range(args.repeats)]
    for run in runs:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in run.items()}), flush=True)
    top = []
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        asyncio.run(one_repeat(cfg, tasks, template, env, 99))
        profiler.disable()
        stats = pstats.Stats(profiler).sort_stats("tottime")
        for (file, line, name), (calls, _, own, total, _) in list(stats.stats.items()):
            top.append({"function": f"{file.split('turnrl/')[-1]}:{line}({name})", "calls": calls, "own_s": own,
                        "total_s": total})
        top.sort(key=lambda row: -row["own_s"])
        top = top[:args.profile]
        for row in top:
            print(f"  {row['own_s'] * 1e3:8.1f} ms own {row['total_s'] * 1e3:8.1f} ms total {row['calls']:7d}x "
                  f"{row['function'][-90:]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "loop_probe", "runs": runs, "profile_top": top, "machine": machine_info()}, f,
                      indent=1)


if __name__ == "__main__":
    main()
