"""End-to-end RL step time, split into the trainer's own phases.

Runs `Trainer.train_step` for `warmup + steps` steps of a config and reads the phase timings the trainer
measures itself (`time/rollout_s`, `time/reward_s`, `time/logprob_s`, `time/update_s`, `time/sync_s`,
`time/step_s`); `other` is the step's remainder (data, batching, metrics, saving samples). The engine's
counters (requests = generate calls, tokens, decode steps, where the engine keeps them) are read around
each step, and so are the process's system CPU time and minor page faults (`sys_s`, `minor_faults`: a CPU
step that grows its heap faults the new memory in). Warm-up steps (kernel compilation, allocator growth) are
kept in `runs` but left out of the summary. Nothing is checkpointed; the run directory is temporary unless
`out` is given.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import Any

import torch

from turnrl.bench.common import delta, engine_stats, host_counters, machine_info, spread
from turnrl.config import Config, to_dict
from turnrl.ledger import Trajectory
from turnrl.llm import close_all as close_llm_clients
from turnrl.train.batching import micro_batches

PHASES = ("rollout", "reward", "logprob", "update", "sync")


async def bench_step(cfg: Config, steps: int, warmup: int = 1, out: str | None = None) -> dict[str, Any]:
    if steps < 1 or warmup < 0:
        raise ValueError("the step benchmark needs --steps >= 1 and --warmup >= 0")
    with tempfile.TemporaryDirectory(prefix="turnrl-bench-step-") as tmp:
        cfg = dataclasses.replace(cfg, output_dir=out or tmp,
                                  trainer=dataclasses.replace(cfg.trainer, steps=warmup + steps, resume=None))
        return await _run(cfg, steps, warmup)


async def _run(cfg: Config, steps: int, warmup: int) -> dict[str, Any]:
    from turnrl.train.trainer import Trainer

    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    setup_s = time.perf_counter() - t0
    seen: list[Trajectory] = []
    rollout = trainer.rollout

    async def recording(*args: Any, **kwargs: Any) -> tuple[list[Trajectory], float]:
        trajs, seconds = await rollout(*args, **kwargs)
        seen[:] = trajs
        return trajs, seconds
    trainer.rollout = recording   # the step's trajectories, for what the metrics do not say
    runs = []
    try:
        for step in range(warmup + steps):
            load = os.getloadavg()[0]
            before, host = engine_stats(trainer.engine), host_counters()
            m = await trainer.train_step(step)
            host = delta(host_counters(), host)   # cpu_s, sys_s, minor_faults
            phases = {f"{p}_s": m[f"time/{p}_s"] for p in PHASES}
            runs.append({"step": step + 1, "warmup": step < warmup, "loadavg_1m": load, **phases,
                         "other_s": m["time/step_s"] - sum(phases.values()),
                         "step_s": m["time/step_s"], **host, "trajectories": m["trajectories"],
                         "trajectories_per_s": m["trajectories"] / m["time/step_s"],
                         "rollout_tokens_per_s": m["throughput/tokens_per_s"],
                         "train_tokens_per_s": m["throughput/train_tokens_per_s"],
                         "response_tokens_mean": m["response_tokens/mean"], "turns_mean": m["turns/mean"],
                         "tool_calls": m["tool/calls"], "masked": m["masked"], "reward_mean": m["reward/mean"],
                         "accuracy": m.get("accuracy"), "engine_stats": delta(engine_stats(trainer.engine), before),
                         "gc_pause_s": m.get("time/gc_pause_s"), "gc_full_collections": m.get("gc/full_collections"),
                         **_trajectory_figures(seen, cfg.trainer.micro_batch_tokens)})
    finally:
        trainer.logger.close()
        await trainer.engine.close()
        await close_llm_clients()
    measured = [r for r in runs if not r["warmup"]]
    keys = [*(f"{p}_s" for p in PHASES), "other_s", "step_s", "cpu_s", "trajectories_per_s", "rollout_tokens_per_s",
            "train_tokens_per_s"]
    summary = {k: spread([r[k] for r in measured]) for k in keys}
    return {"benchmark": "step", "summary": summary, "runs": runs, "setup_s": setup_s,
            "reward_last_step": runs[-1]["reward_mean"],
            "config": {**to_dict(cfg), "bench": {"steps": steps, "warmup": warmup}}, "machine": machine_info()}


def _trajectory_figures(trajs: list[Trajectory], micro_batch_tokens: int) -> dict[str, Any]:
    """Tool time (summed over trajectories: they overlap in time), the tasks, and the padding of the update's
    token-budget micro-batches."""
    lengths = torch.tensor([len(seg) for t in trajs for seg in t.segments])
    padded = sum(len(index) * width for index, width in micro_batches(torch.arange(len(lengths)), lengths,
                                                                      micro_batch_tokens))
    return {"tools_s_sum": sum(t.timings.get("tools_s", 0.0) for t in trajs),
            "generate_s_sum": sum(t.timings.get("generate_s", 0.0) for t in trajs),
            "train_padding_fraction": 1 - int(lengths.sum()) / padded if padded else None,
            "uids": list(dict.fromkeys(t.group_id for t in trajs))}


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    r = cfg["rollout"]
    lines = [f"step benchmark: {cfg['model']['name']} engine={cfg['engine']['kind']} "
             f"{cfg['data']['prompts_per_step']} prompts x n={r['n']}, lora rank {cfg['model']['lora']['rank']}, "
             f"setup {report['setup_s']:.1f} s",
             f"{'step':>4} {'rollout':>8} {'reward':>7} {'logprob':>8} {'update':>7} {'sync':>6} {'other':>6} "
             f"{'step s':>7} {'traj/s':>7} {'gen tok/s':>9} {'reward':>7} {'turns':>5} {'calls':>5} {'load':>5} "
             f"{'sys s':>6}"]
    for run in report["runs"]:
        lines.append(f"{run['step']:>3}{'w' if run['warmup'] else ' '} {run['rollout_s']:>8.2f} "
                     f"{run['reward_s']:>7.3f} "
                     f"{run['logprob_s']:>8.2f} {run['update_s']:>7.2f} {run['sync_s']:>6.2f} {run['other_s']:>6.2f} "
                     f"{run['step_s']:>7.2f} {run['trajectories_per_s']:>7.3f} {run['rollout_tokens_per_s']:>9.1f} "
                     f"{run['reward_mean']:>7.3f} {run['turns_mean']:>5.2f} {run['tool_calls']:>5} "
                     f"{run['loadavg_1m']:>5.1f} {run['sys_s']:>6.2f}")
    lines.append(f"  {'over measured steps (w: warm-up)':<34} {'min':>9} {'median':>9} {'max':>9}")
    for key, spread in report["summary"].items():
        lines.append(f"  {key:<34} {spread['min']:>9.3f} {spread['median']:>9.3f} {spread['max']:>9.3f}")
    mach = report["machine"]
    lines.append(f"machine: {mach['cpus_usable']}/{mach['cpu_count']} cpus, gpu={mach['gpu']}, "
                 f"{', '.join(f'{k} {v}' for k, v in mach['versions'].items())}")
    return "\n".join(lines)
