"""One rollout of the race's `wide` work (float32), timed inside the engine: where a CPU rollout's time goes.

    PYTHONPATH=. python benchmarks/race_rollout_probe.py [--keep-pools] [--json out.json] [overrides ...]

Builds the trainer as `turnrl bench step` does for `benchmarks/trl_race/run.sh --workload wide --fp32` (the
transformers engine unless an override says `engine.kind=vllm`), runs step 0's rollout (16 trajectories) and
reports rollout, prefill and engine-busy seconds; on the transformers engine's lean decode step also ms a decode
step, the mean rows and cache length, and the seconds in its weight products. `--keep-pools` takes out the
OpenMP pool releases of turnrl/engines/omp_pool.py (the engine's worker and the trainer keep their workers), for
an A/B in one command. Overrides as on the command line, e.g. `engine.cpu_gemm=false`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

WIDE_FP32 = ["engine.kind=hf", "data.train.seed=7", "data.train.options.steps=3", "data.train.options.max_value=60",
             "rollout.n=4", "rollout.max_assistant_turns=4", "rollout.max_response_tokens=300",
             "rollout.sampling.max_tokens_per_turn=96", "rollout.sampling.temperature=1.0", "data.prompts_per_step=4",
             "engine.dtype=float32", "trainer.dtype=float32"]


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep-pools", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--output-dir", default="/tmp/turnrl-race-rollout-probe")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from turnrl.config import load_config
    from turnrl.train.trainer import Trainer
    if a.keep_pools:
        import turnrl.engines.vllm as vllm_engine
        import turnrl.engines.worker as worker
        import turnrl.train.trainer as trainer_module
        for module in (worker, trainer_module, vllm_engine):
            module.release_idle_pool = lambda: False
    cfg = load_config("examples/calculator/train.yaml", WIDE_FP32 + a.overrides + [
        f"output_dir={a.output_dir}", "logging.progress=off", "logging.sinks=[]"])
    trainer = Trainer(cfg)
    engine = trainer.engine
    lean = getattr(engine, "lean", None)
    steps: list[tuple[int, int, float]] = []
    linear_s = [0.0]
    if lean is not None:
        products = lean.linear

        def timed_products(*args):
            start = time.perf_counter()
            out = products(*args)
            linear_s[0] += time.perf_counter() - start
            return out
        lean.linear = timed_products if products is not torch.nn.functional.linear else products
        step = type(lean).__call__

        def timed_step(self, ids, positions, mask, cache):
            start = time.perf_counter()
            out = step(self, ids, positions, mask, cache)
            steps.append((ids.shape[0], mask.shape[1], time.perf_counter() - start))
            return out
        type(lean).__call__ = timed_step

    async def go():
        try:
            return await trainer.rollout(trainer.data.take(cfg.data.prompts_per_step), cfg.rollout.n, 0)
        finally:
            await engine.close()
    trajs, seconds = asyncio.run(go())
    stats = getattr(engine, "stats", {})
    report = {"engine": cfg.engine.kind, "keep_pools": a.keep_pools, "overrides": a.overrides,
              "trajectories": len(trajs), "rollout_s": seconds,
              "engine_stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))}}
    if steps:
        lean_s = sum(s[2] for s in steps)
        report["lean_step"] = {"steps": len(steps), "seconds": lean_s, "ms_per_step": lean_s / len(steps) * 1e3,
                               "rows_mean": sum(s[0] for s in steps) / len(steps),
                               "cache_len_mean": sum(s[1] for s in steps) / len(steps),
                               "products_s": linear_s[0] if lean.linear is not products else None,
                               "products": "kernel" if products is not torch.nn.functional.linear else "linear"}
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
