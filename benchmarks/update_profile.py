"""Where the update of one real RL step goes: the race's `wide` work, float32, the transformers engine.

Runs the trainer for one step (the warm-up), records the trajectories of a second step's rollout, then runs the
update on them (`run_step`: rows, advantages, the policy update) `--repeats` times, the last one under
torch.profiler, and prints the ops by self CPU time and the phase timings. The update changes the LoRA weights
each repeat; the work (rows, tokens, micro-batches) is the same.

    PYTHONPATH=. python benchmarks/update_profile.py [--repeats 3] [--json out.json] [override ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import time
from typing import Any

import torch

WIDE = ["data.train.seed=7", "data.train.options.steps=3", "data.train.options.max_value=60", "rollout.n=4",
        "rollout.max_assistant_turns=4", "rollout.max_response_tokens=300", "rollout.sampling.max_tokens_per_turn=96",
        "rollout.sampling.temperature=1.0", "data.prompts_per_step=4", "engine.dtype=float32",
        "trainer.dtype=float32", "engine.kind=hf", "logging.progress=off"]


async def main(a: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from turnrl.config import load_config
    from turnrl.train.step import run_step
    from turnrl.train.trainer import Trainer

    out = tempfile.mkdtemp(prefix="turnrl-update-profile-")
    work = WIDE if a.work == "wide" else ["engine.kind=hf", "logging.progress=off"]   # main: the main job's work
    cfg = load_config("examples/calculator/train.yaml", [*work, f"output_dir={out}", "trainer.steps=2", *a.overrides])
    trainer = Trainer(cfg)
    seen: list = []
    rollout = trainer.rollout

    async def recording(*args: Any, **kwargs: Any):
        trajs, seconds = await rollout(*args, **kwargs)
        seen.append(trajs)
        return trajs, seconds
    trainer.rollout = recording
    first_table, first_faults = "", []
    update = trainer.update

    async def watched(rows):        # the first step's update: page faults, and with --first its profile
        nonlocal first_table
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if a.first:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out = await update(rows)
            first_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows)
        else:
            out = await update(rows)
        first_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        trainer.update = update
        return out
    trainer.update = watched
    first = await trainer.train_step(0)
    print(first_table)
    await trainer.train_step(1)
    trajs = seen[a.step]
    times = []
    for i in range(a.repeats):
        last = i == a.repeats - 1 and a.profile
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if last else None
        faults, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        if prof is not None:
            with prof:
                m = await run_step(trainer, trainer.step_inputs, trajs, a.step, 0.0)
        else:
            m = await run_step(trainer, trainer.step_inputs, trajs, a.step, 0.0)
        times.append({"wall_s": time.perf_counter() - t0, "logprob_s": m["time/logprob_s"],
                      "update_s": m["time/update_s"], "profiled": last,
                      "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults})
        print(json.dumps(times[-1]), flush=True)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows) if prof is not None else ""
    print(table)
    tokens = sum(t.n_tokens() for t in trajs)
    await trainer.engine.close()
    return {"benchmark": "update_profile", "work": a.work, "overrides": [*work, *a.overrides], "trajectories": len(trajs),
            "tokens": tokens, "first_step_update_s": first["time/update_s"],
            "first_step_update_minor_faults": first_faults[0], "repeats": times, "profile": table,
            "first_profile": first_table}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--first", action="store_true", help="also profile the first step's update")
    p.add_argument("--work", choices=("wide", "main"), default="wide", help="the race's wide work or the main job's")
    p.add_argument("--step", type=int, default=1, choices=(0, 1), help="repeat the update of this step's rows")
    p.add_argument("--json")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    report = asyncio.run(main(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
