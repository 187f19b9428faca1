"""Multi-turn rollout throughput against the same engine's offline throughput on the same token counts.

One repeat has two phases on one engine (built and warmed up once):

1. multi-turn: `n` samples of each task through the real agent loop (tools, simulated users, limits), every
   trajectory its own coroutine; throughput = policy tokens generated / wall time of the whole batch.
2. offline: every policy turn of phase 1 becomes one independent single-turn request, all submitted at
   once: the prompt is exactly the context that turn saw and `max_tokens` its generated length, with no stop
   token, so each request generates exactly that many tokens (both engines stop only on the request's stop
   tokens). The two phases therefore prefill the same prompt tokens and generate the same number of tokens;
   what the offline phase lacks is the waiting: for earlier turns, tools and simulated users.

The ratio multi / offline says how much of the engine's batch throughput the agent loop keeps (goal >= 0.9).
Engines with a prefix cache start each phase with an empty one, so phase 2 cannot reuse phase 1's prompts
(within a phase, reuse is the engine's business: phase 1's later turns extend earlier ones). That reuse can
put the ratio above 1: a later turn of phase 1 finds its earlier turns' tokens cached, while phase 2 runs
all turns at once and prefills them again.

Phase 1 also reports `loop_cpu_s`, the CPU time of the event-loop thread (agent loop, chat deltas, parsers,
ledger), against `process_cpu_s` for the whole process (mostly the engine); the table shows it as a share of
the phase's wall time. The 1-minute load average is taken before and after each repeat: on a shared machine
another process's load moves both phases.

Phase 1's `prefill` (`prefill_accounting`) sets what the engine prefilled (its `prefill_tokens` counter: tokens
computed, reused ones not counted) against what each turn's context holds and what is new in it, turn by turn:
with no reuse a later turn prefills its whole context, with each trajectory's KV kept between turns only the new
tokens (the environment's reply and the chat template's tokens around it).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

from turnrl.bench.common import delta, engine_stats, machine_info, spread
from turnrl.config.loader import to_dict
from turnrl.config.schema import EngineConfig, RolloutConfig
from turnrl.data import Task
from turnrl.engines.base import Engine, Sampling
from turnrl.ledger import Source, Trajectory
from turnrl.observe.gc_heap import freeze_heap, gc_pauses
from turnrl.rollout.factory import build_engine, build_environment, build_loop, load_template
from turnrl.rollout.scheduler import run_batch


async def bench_rollout(model_dir: str | Path, engine_cfg: EngineConfig, rollout_cfg: RolloutConfig,
                        tasks: list[Task], repeats: int, seed: int = 0, warmup_repeats: int = 0) -> dict[str, Any]:
    """`warmup_repeats` more repeats run first: reported with `warmup: true`, left out of the summary (on a GPU
    the first repeats compile kernels and capture graphs for the buckets they meet)."""
    if repeats < 1 or warmup_repeats < 0 or not tasks:
        raise ValueError("the rollout benchmark needs at least one task and one repeat (and warmup_repeats >= 0)")
    template = load_template(model_dir)
    env = build_environment(rollout_cfg)
    t0 = time.perf_counter()
    engine = build_engine(engine_cfg, model_dir)
    startup = time.perf_counter() - t0
    runs = []
    try:
        await _warm_up(engine, template.encode("Hello, how are you today?"))
        for r in range(warmup_repeats + repeats):
            if r == warmup_repeats and warmup_repeats and engine_cfg.gc_freeze:
                freeze_heap()   # what the warm-up compiled and captured, as a trainer does after its first step
            load = os.getloadavg()[0]
            await _reset_cache(engine)
            before, gc_before = engine_stats(engine), gc_pauses().snapshot()
            multi = await _multi_turn(engine, template, env, rollout_cfg, tasks, seed)
            multi["engine_stats"], before = delta(engine_stats(engine), before), engine_stats(engine)
            multi["gc"], gc_before = gc_pauses().since(gc_before), gc_pauses().snapshot()
            multi["prefill"] = prefill_accounting(multi["trajectories"], multi["engine_stats"].get("prefill_tokens"))
            await _reset_cache(engine)
            offline = await _offline(engine, multi.pop("trajectories"), rollout_cfg.sampling.temperature, seed)
            offline["engine_stats"] = delta(engine_stats(engine), before)
            offline["gc"] = gc_pauses().since(gc_before)
            runs.append({"repeat": r, "warmup": r < warmup_repeats, "loadavg_1m": load,
                         "loadavg_1m_end": os.getloadavg()[0],
                         "multi_turn": multi, "offline": offline,
                         "ratio": multi["policy_tokens_per_s"] / offline["generated_tokens_per_s"]})
    finally:
        await engine.close()
    summary = {key: spread([get(run) for run in runs if not run["warmup"]]) for key, get in (
        ("multi_turn_tokens_per_s", lambda run: run["multi_turn"]["policy_tokens_per_s"]),
        ("offline_tokens_per_s", lambda run: run["offline"]["generated_tokens_per_s"]),
        ("ratio", lambda run: run["ratio"]))}
    return {"benchmark": "rollout", "summary": summary, "runs": runs, "engine_startup_s": startup,
            "config": {"engine": to_dict(engine_cfg), "rollout": to_dict(rollout_cfg), "model": str(model_dir),
                       "tasks": len(tasks), "task_source": sorted({t.info.get("data_source", "") for t in tasks}),
                       "repeats": repeats, "warmup_repeats": warmup_repeats, "seed": seed},
            "machine": machine_info()}


async def _warm_up(engine: Engine, prompt: list[int]) -> None:
    """First steps compile kernels and allocate: keep them out of the measurement."""
    await asyncio.gather(*(engine.generate(prompt[: 2 + i], Sampling(max_tokens=8, seed=i)) for i in range(4)))


async def _reset_cache(engine: Engine) -> None:
    await engine.reset_prefix_cache()


async def _multi_turn(engine: Engine, template: Any, env: Any, cfg: RolloutConfig, tasks: list[Task],
                      seed: int) -> dict[str, Any]:
    loop = build_loop(cfg, engine, template, env, seed)
    start, cpu, loop_cpu = time.perf_counter(), time.process_time(), time.thread_time()
    trajs = await run_batch(loop, tasks, cfg.n, cfg.concurrency)
    seconds = time.perf_counter() - start
    # The event loop's own CPU (agent loop, chat deltas, parsers, ledger) against the whole process's (engine).
    loop_cpu, cpu = time.thread_time() - loop_cpu, time.process_time() - cpu
    policy = sum(t.n_tokens(Source.POLICY) for t in trajs)
    turns = sum(len(t.turns) for t in trajs)
    errors: dict[str, int] = {}
    for t in trajs:
        for e in t.errors:
            errors[e.kind] = errors.get(e.kind, 0) + 1
    return {"trajectories": trajs, "seconds": seconds, "policy_tokens": policy,
            "prompt_tokens": sum(turn.start for t in trajs for turn in t.turns),
            "env_tokens": sum(t.n_tokens(Source.TOOL) + t.n_tokens(Source.USER) for t in trajs),
            "turns": turns, "turns_per_trajectory": turns / len(trajs),
            "tool_calls": sum(len(turn.tool_calls) for t in trajs for turn in t.turns),
            "user_turns": sum(turn.user_reply is not None for t in trajs for turn in t.turns),
            "generate_s_mean": statistics.fmean(t.timings.get("generate_s", 0.0) for t in trajs),
            "tools_s_mean": statistics.fmean(t.timings.get("tools_s", 0.0) for t in trajs),
            "interaction_s_mean": statistics.fmean(t.timings.get("interaction_s", 0.0) for t in trajs),
            "errors": errors, "loop_cpu_s": loop_cpu, "process_cpu_s": cpu, "policy_tokens_per_s": policy / seconds}


def prefill_accounting(trajs: list[Trajectory], engine_prefill: float | None) -> dict[str, Any]:
    """Per turn index: requests, `context_tokens` (the context each turn saw: what an engine prefills with no
    reuse), `new_tokens` (what came since the trajectory's previous turn ended: the environment's reply and the
    template's tokens around it; a first turn's whole prompt, and the whole context after a segment split: what
    an engine that keeps each trajectory's KV between turns prefills) and `generated_tokens`.

    `shared_first_turn_tokens`: the distinct token prefixes of all first-turn prompts (samples of one task share
    their prompt), what a cache shared between trajectories prefills for the first turns. With the engine's
    prefill count E (None: the engine keeps none), the later turns' share is bounded by what the first turns
    took: at most their whole prompts, at least the shared prefixes, so `engine_prefill_per_later_turn` is
    low = (E - first-turn context) / later turns, high = (E - shared_first_turn_tokens) / later turns (equal
    bounds need no reuse in the first turns; an engine without a cache meets the low one exactly)."""
    rows: dict[int, dict[str, int]] = {}
    first_prompts = set()
    for traj in trajs:
        previous = None
        for turn in traj.turns:
            row = rows.setdefault(turn.index, {"turn": turn.index, "requests": 0, "context_tokens": 0,
                                               "new_tokens": 0, "generated_tokens": 0})
            same_segment = previous is not None and previous.segment == turn.segment
            row["requests"] += 1
            row["context_tokens"] += turn.start
            row["new_tokens"] += turn.start - previous.end if same_segment else turn.start
            row["generated_tokens"] += turn.end - turn.start
            if turn.index == 0:
                first_prompts.add(tuple(traj.segments[turn.segment].token_ids[:turn.start]))
            previous = turn
    shared = _trie_size(first_prompts)
    per_turn = [rows[k] for k in sorted(rows)]
    later = [r for r in per_turn if r["turn"] > 0]
    n_later = sum(r["requests"] for r in later)
    first_context = sum(r["context_tokens"] for r in per_turn if r["turn"] == 0)
    out: dict[str, Any] = {
        "per_turn": per_turn, "context_tokens": sum(r["context_tokens"] for r in per_turn),
        "new_tokens": sum(r["new_tokens"] for r in per_turn), "shared_first_turn_tokens": shared,
        "later_turns": n_later,
        "later_context_tokens_per_turn": sum(r["context_tokens"] for r in later) / n_later if n_later else None,
        "later_new_tokens_per_turn": sum(r["new_tokens"] for r in later) / n_later if n_later else None,
        "engine_prefill_tokens": engine_prefill, "engine_prefill_per_later_turn": None}
    if engine_prefill is not None and n_later:
        out["engine_prefill_per_later_turn"] = {"low": (engine_prefill - first_context) / n_later,
                                                "high": (engine_prefill - shared) / n_later}
    return out


def _trie_size(sequences: Any) -> int:
    """Distinct non-empty prefixes of the sequences: the nodes of their token trie."""
    root: dict[int, Any] = {}
    nodes = 0
    for seq in sequences:
        node = root
        for tok in seq:
            if tok not in node:
                node[tok] = {}
                nodes += 1
            node = node[tok]
    return nodes


async def _offline(engine: Engine, trajs: list[Trajectory], temperature: float, seed: int) -> dict[str, Any]:
    requests = [(traj.segments[turn.segment].token_ids[:turn.start], turn.end - turn.start)
                for traj in trajs for turn in traj.turns if turn.end > turn.start]
    start, cpu = time.perf_counter(), time.process_time()
    outs = await asyncio.gather(*(
        engine.generate(prompt, Sampling(max_tokens=k, temperature=temperature, seed=seed * 1_000_003 + i))
        for i, (prompt, k) in enumerate(requests)))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    generated = sum(len(o.token_ids) for o in outs)
    wanted = sum(k for _, k in requests)
    return {"requests": len(requests), "seconds": seconds, "prompt_tokens": sum(len(p) for p, _ in requests),
            "generated_tokens": generated, "matched": generated == wanted, "process_cpu_s": cpu,
            "generated_tokens_per_s": generated / seconds}


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [f"rollout benchmark: engine={cfg['engine']['kind']} tasks={cfg['tasks']} x n={cfg['rollout']['n']} "
             f"{'/'.join(cfg['task_source'])}, max_tokens_per_turn={cfg['rollout']['sampling']['max_tokens_per_turn']}",
             f"{'repeat':>6} {'multi tok/s':>12} {'offline tok/s':>14} {'ratio':>6} {'multi s':>8} "
             f"{'offline s':>9} {'policy tok':>10} {'prompt tok':>10} {'turns/traj':>10} {'tools':>6} {'loop cpu':>8} "
             f"{'gc s m/o':>9} {'load':>5}"]
    for run in report["runs"]:
        m, o = run["multi_turn"], run["offline"]
        mark = "w" if run.get("warmup") else " "
        lines.append(f"{run['repeat']:>5}{mark} {m['policy_tokens_per_s']:>12.1f} {o['generated_tokens_per_s']:>14.1f} "
                     f"{run['ratio']:>6.3f} {m['seconds']:>8.1f} {o['seconds']:>9.1f} {m['policy_tokens']:>10} "
                     f"{m['prompt_tokens']:>10} {m['turns_per_trajectory']:>10.2f} {m['tool_calls']:>6} "
                     f"{m['loop_cpu_s'] / m['seconds']:>8.1%} {_gc(m)}/{_gc(o)} {run['loadavg_1m']:>5.1f}")
    warm = sum(1 for run in report["runs"] if run.get("warmup"))
    lines.append(f"  {'over repeats' + (f' (not the {warm} w)' if warm else ''):<26} {'min':>10} {'median':>10} "
                 f"{'max':>10}")
    for key, spread in report["summary"].items():
        lines.append(f"  {key:<26} {spread['min']:>10.3f} {spread['median']:>10.3f} {spread['max']:>10.3f}")
    for run in report["runs"]:
        p = run["multi_turn"].get("prefill")
        if p and p["later_turns"]:
            engine = p["engine_prefill_per_later_turn"]
            lines.append(f"  repeat {run['repeat']} prefill per later turn ({p['later_turns']} turns): context "
                         f"{p['later_context_tokens_per_turn']:.1f}, new {p['later_new_tokens_per_turn']:.1f}, engine "
                         + (f"{engine['low']:.1f}..{engine['high']:.1f}" if engine else "not counted")
                         + f"; all turns: context {p['context_tokens']}, new {p['new_tokens']}, engine "
                         f"{p['engine_prefill_tokens']}")
    mach = report["machine"]
    lines.append(f"machine: {mach['cpus_usable']}/{mach['cpu_count']} cpus, gpu={mach['gpu']}, "
                 f"{', '.join(f'{k} {v}' for k, v in mach['versions'].items())}; engine startup "
                 f"{report['engine_startup_s']:.1f} s")
    return "\n".join(lines)


def _gc(phase: dict[str, Any]) -> str:
    """The phase's garbage-collection pause seconds (runs from before the counter show '-')."""
    gc = phase.get("gc")
    return f"{gc['time/gc_pause_s']:>4.2f}" if gc else "   -"
