"""`turnrl bench rollout|train|step|compare|engine`: each prints a table and writes JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

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
    q.add_argument("--warmup-repeats", type=int, default=0, help="repeats run first and left out of the summary "
                   "(kernel compilation, graph captures)")
    q.add_argument("--max-tokens", type=int, default=None, help="rollout.sampling.max_tokens_per_turn")
    q.add_argument("--temperature", type=float, default=None, help="rollout.sampling.temperature")
    q.add_argument("--json", required=True, help="where to write the report")

    q = sub.add_parser("train", help="update-path training throughput (tokens/s, MFU) on synthetic multi-turn rows")
    q.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. trainer.micro_batch_tokens=8192")
    q.add_argument("--config", default=None, help="YAML config (algo, trainer, model.lora); defaults otherwise")
    q.add_argument("--model", default=None, help="model spec, or a shape model: qwen2.5-0.5b-shape, "
                   "smollm2-135m-shape, tiny-shape (random init, no download); default: the config's")
    q.add_argument("--batch", type=int, default=32, help="rows per update (default 32: 4 prompts x 8 samples)")
    q.add_argument("--seq-len", type=int, default=512, help="longest row; rows are uniform in [T/2, T]")
    q.add_argument("--min-fraction", type=float, default=0.5, help="shortest row as a fraction of --seq-len")
    q.add_argument("--lora-rank", type=int, default=None, help="model.lora.rank (0: full fine-tuning); "
                   "with no --lora-alpha, alpha = 2 x rank")
    q.add_argument("--lora-alpha", type=float, default=None)
    q.add_argument("--steps", type=int, default=3, help="updates per repeat")
    q.add_argument("--warmup", type=int, default=1, help="updates before timing")
    q.add_argument("--repeats", type=int, default=3)
    q.add_argument("--peak-tflops", type=float, default=None,
                   help="peak FLOP/s for MFU (default: 790 on an H200, else unknown and MFU is left out)")
    q.add_argument("--profile", action="store_true",
                   help="after timing, profile one update and one logprob pass: device time by kernel kind")
    q.add_argument("--json", required=True, help="where to write the report")

    q = sub.add_parser("step", help="end-to-end RL step time split into rollout/reward/logprob/update/sync")
    q.add_argument("config", help="YAML config")
    q.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. engine.kind=hf")
    q.add_argument("--steps", type=int, default=3, help="measured steps")
    q.add_argument("--warmup", type=int, default=1, help="steps before them, left out of the summary")
    q.add_argument("--out", default=None, help="run directory to keep (default: a temporary one)")
    q.add_argument("--json", required=True, help="where to write the report")

    q = sub.add_parser("compare", help="ratios per figure of two reports, or run `bench step` on two configs")
    q.add_argument("reports", nargs="*", help="A.json B.json (two benchmark reports of the same kind)")
    q.add_argument("--configs", nargs=2, metavar=("A.yaml", "B.yaml"), default=None,
                   help="run `turnrl bench step` on both configs, then compare")
    q.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides for both configs (with --configs)")
    q.add_argument("--steps", type=int, default=3)
    q.add_argument("--warmup", type=int, default=1)
    q.add_argument("--json", default=None, help="also write the comparison (with both reports) here")

    q = sub.add_parser("engine", help="decode tok/s of model.generate, the HF engine and the fast engine, one workload")
    q.add_argument("--model", default="qwen2.5-0.5b-shape", help="a shape model (qwen2.5-0.5b-shape, "
                   "smollm2-135m-shape, tiny-shape: random init) or a model spec")
    q.add_argument("--batch", type=int, default=256, help="requests, all submitted at once")
    q.add_argument("--prompt", type=int, default=256, help="prompt tokens per request (random ids)")
    q.add_argument("--new", type=int, default=256, help="tokens each request generates (no stop token)")
    q.add_argument("--variants", default="generate,hf,fast,fast-compile",
                   help="comma-separated: generate, hf, fast (CUDA graphs), fast-compile (+ torch.compile), "
                   "fast-exact (engine.exact)")
    q.add_argument("--device", default="auto")
    q.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    q.add_argument("--json", required=True, help="where to write the report (rewritten after each variant)")

    q = sub.add_parser("gateway", help="gateway overhead per request vs direct engine calls; agents through it vs "
                       "the native loop")
    q.add_argument("overrides", nargs="*", help="dotted config overrides for the throughput part, e.g. engine.kind=vllm")
    q.add_argument("--config", default=None, help="YAML config (model, engine, rollout); defaults otherwise")
    q.add_argument("--sessions", default="1,256", help="concurrent sessions for the overhead part (comma-separated)")
    q.add_argument("--turns", type=int, default=8, help="calls per session in the overhead part")
    q.add_argument("--engine-ms", default="0", help="the stand-in engine's latency per call in the overhead part, "
                   "milliseconds (comma-separated: a row set each; 0 answers at once)")
    q.add_argument("--clients", default="httpx,aiohttp", help="clients in another process for the overhead part")
    q.add_argument("--repeats", type=int, default=1, help="measure each client (and its floor) this many times in "
                   "a row; the report keeps each repeat's p50/p99")
    q.add_argument("--prompts", type=int, default=8, help="calculator tasks for the throughput part (0: skip it)")
    q.add_argument("--n", type=int, default=2, help="samples per task")
    q.add_argument("--json", required=True, help="where to write the report")


@command("bench", "benchmarks (each prints a table and writes JSON)", _bench_args)
def cmd_bench(a: argparse.Namespace) -> int:
    return {"rollout": _rollout, "train": _train, "step": _step, "compare": _compare, "engine": _engine,
            "gateway": _gateway}[a.bench](a)


def _write(path: str, report: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


def _rollout(a: argparse.Namespace) -> int:
    from turnrl.bench.rollout import bench_rollout, format_report
    from turnrl.data import load_dataset
    from turnrl.models import resolve

    flags = [f"engine.kind={a.engine}" if a.engine else None, f"rollout.n={a.n}",
             f"rollout.sampling.max_tokens_per_turn={a.max_tokens}" if a.max_tokens else None,
             f"rollout.sampling.temperature={a.temperature}" if a.temperature is not None else None]
    cfg = load_config(a.config, list(a.overrides) + [f for f in flags if f])
    if a.prompts < 1 or a.repeats < 1 or a.warmup_repeats < 0:
        raise SystemExit("error: --prompts and --repeats must be >= 1, --warmup-repeats >= 0")
    tasks = load_dataset(task=a.task, size=a.prompts, seed=cfg.seed, options=TASK_OPTIONS.get(a.task, {}))
    report = asyncio.run(bench_rollout(resolve(cfg.model.name), cfg.engine, cfg.rollout, tasks, a.repeats,
                                       cfg.seed, a.warmup_repeats))
    print(format_report(report))
    _write(a.json, report)
    return 0


def _train(a: argparse.Namespace) -> int:
    from turnrl.bench.train import bench_train, format_report

    rank = 32 if a.lora_rank is None and a.config is None else a.lora_rank   # the main job's LoRA by default
    flags = [f"model.name={a.model}" if a.model else None,
             f"model.lora.rank={rank}" if rank is not None else None,
             f"model.lora.alpha={a.lora_alpha if a.lora_alpha is not None else 2 * rank}" if rank else None]
    cfg = load_config(a.config, [f for f in flags if f] + list(a.overrides))
    if a.batch < 1 or a.seq_len < 4:
        raise SystemExit("error: --batch must be >= 1 and --seq-len >= 4")
    try:
        report = bench_train(cfg, a.batch, a.seq_len, a.steps, a.repeats, a.warmup, a.peak_tflops, a.min_fraction,
                             profile=a.profile)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(format_report(report))
    _write(a.json, report)
    return 0


def _step(a: argparse.Namespace) -> int:
    from turnrl.bench.step import bench_step, format_report

    cfg = load_config(a.config, list(a.overrides))
    try:
        report = asyncio.run(bench_step(cfg, a.steps, a.warmup, a.out))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(format_report(report))
    _write(a.json, report)
    return 0


def _compare(a: argparse.Namespace) -> int:
    from turnrl.bench.compare import compare, format_comparison, run_step_reports

    if a.configs and a.reports:
        raise SystemExit("error: give two report files or --configs A.yaml B.yaml, not both")
    if a.configs:
        if a.json:
            out_dir = Path(a.json).with_suffix("")
            reports = run_step_reports(a.configs, a.overrides, a.steps, a.warmup, out_dir)
        else:
            with tempfile.TemporaryDirectory(prefix="turnrl-compare-") as tmp:
                reports = run_step_reports(a.configs, a.overrides, a.steps, a.warmup, Path(tmp))
        names = tuple(a.configs)
    elif len(a.reports) == 2:
        reports = [json.loads(Path(p).read_text()) for p in a.reports]
        names = tuple(a.reports)
    else:
        raise SystemExit("error: bench compare needs two report files (A.json B.json) or --configs A.yaml B.yaml")
    try:
        result = compare(*reports)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(format_comparison(result, names))
    if a.json:
        _write(a.json, {**result, "names": list(names), "a": reports[0], "b": reports[1]})
    return 0


def _engine(a: argparse.Namespace) -> int:
    from turnrl.bench.engine import bench_engine, format_report

    def checkpoint(report: dict[str, Any]) -> None:   # a later variant that crashes the process loses nothing
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=2))

    try:
        report = bench_engine(a.model, a.batch, a.prompt, a.new, [v for v in a.variants.split(",") if v], a.device,
                              a.dtype, on_variant=checkpoint)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(format_report(report))
    _write(a.json, report)
    return 0


def _gateway(a: argparse.Namespace) -> int:
    from turnrl.bench.gateway import bench_agent_throughput, bench_overhead, format_report
    from turnrl.data import load_dataset
    from turnrl.models import resolve
    from turnrl.rollout.factory import build_engine, build_environment, build_loop, load_template, sampling_from

    cfg = load_config(a.config, ["rollout.sampling.temperature=0", "rollout.max_assistant_turns=3"] + list(a.overrides))
    model_dir = resolve(cfg.model.name)
    template = load_template(model_dir)
    sessions = [int(s) for s in a.sessions.split(",") if s]
    if a.repeats < 1 or a.turns < 1 or not sessions or min(sessions) < 1:
        raise SystemExit("error: --repeats, --turns and each of --sessions must be >= 1")

    async def run() -> dict[str, Any]:
        latencies = [float(x) for x in a.engine_ms.split(",") if x]
        report: dict[str, Any] = {"engine": cfg.engine.kind}
        # the JSON is rewritten after each row: a run stopped by a time limit keeps what it measured
        report["overhead"] = await bench_overhead(template, sessions, a.turns, latencies,
                                                  [c for c in a.clients.split(",") if c], a.repeats,
                                                  on_row=lambda part: _write(a.json, {**report, "overhead": part}))
        if a.prompts > 0:
            tasks = load_dataset(task="calculator", size=a.prompts, seed=cfg.seed, options={"demo": True})
            engine = build_engine(cfg.engine, model_dir)
            try:
                loop = build_loop(cfg.rollout, engine, template, build_environment(cfg.rollout), cfg.seed,
                                  sampling_from(cfg.rollout))
                report["throughput"] = await bench_agent_throughput(engine, template, loop, tasks, a.n,
                                                                    cfg.rollout.concurrency,
                                                                    min(cfg.rollout.max_context_tokens,
                                                                        cfg.engine.max_model_len))
            finally:
                await engine.close()
        return report

    report = asyncio.run(run())
    print(format_report(report))
    _write(a.json, report)
    return 0
