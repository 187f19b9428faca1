"""`turnrl bench rollout`: multi-turn rollout throughput against the same engine's offline throughput."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from turnrl.cli import command
from turnrl.config import load_config

TASK_OPTIONS = {"calculator": {"demo": True}}   # a worked example, so a small model does call the tool


def _bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    q = sub.add_parser("rollout", help="multi-turn rollout throughput vs offline batch throughput, same tokens")
    q.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. engine.cpu_kv_cache_gb=4")
    q.add_argument("--config", default=None, help="YAML config (model, engine, rollout); defaults otherwise")
    q.add_argument("--engine", choices=["hf", "vllm"], default=None, help="engine.kind (default: the config's)")
    q.add_argument("--task", default="calculator", help="built-in task (calculator, feedback_math, guess_number)")
    q.add_argument("--prompts", type=int, default=16, help="tasks per batch")
    q.add_argument("--n", type=int, default=4, help="samples per task")
    q.add_argument("--repeats", type=int, default=3)
    q.add_argument("--max-tokens", type=int, default=None, help="rollout.sampling.max_tokens_per_turn")
    q.add_argument("--temperature", type=float, default=None, help="rollout.sampling.temperature")
    q.add_argument("--json", required=True, help="where to write the report")


@command("bench", "benchmarks (each prints a table and writes JSON)", _bench_args)
def cmd_bench(a: argparse.Namespace) -> int:
    from turnrl.bench.rollout import bench_rollout, format_report
    from turnrl.data import load_dataset
    from turnrl.models import resolve

    flags = [f"engine.kind={a.engine}" if a.engine else None, f"rollout.n={a.n}",
             f"rollout.sampling.max_tokens_per_turn={a.max_tokens}" if a.max_tokens else None,
             f"rollout.sampling.temperature={a.temperature}" if a.temperature is not None else None]
    cfg = load_config(a.config, list(a.overrides) + [f for f in flags if f])
    if a.prompts < 1 or a.repeats < 1:
        raise SystemExit("error: --prompts and --repeats must be >= 1")
    tasks = load_dataset(task=a.task, size=a.prompts, seed=cfg.seed, options=TASK_OPTIONS.get(a.task, {}))
    report = asyncio.run(bench_rollout(resolve(cfg.model.name), cfg.engine, cfg.rollout, tasks, a.repeats,
                                       cfg.seed))
    print(format_report(report))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {a.json}")
    return 0
