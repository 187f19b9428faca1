"""The race: turnrl against TRL's GRPOTrainer with tools, on equal work, on this machine.

For each engine class (plain transformers generation: `hf`; vLLM colocated in the trainer's process:
`vllm`) it runs, each in its own process and one after the other:
- turnrl: `turnrl bench step examples/calculator/train.yaml engine.kind=ENGINE --steps N --warmup 0`
- TRL: `trl_arm.py --engine ENGINE --steps N` (GRPOTrainer, tools=[calculator], same tasks and settings)
and prints step time, trajectories/s, where the time goes, and the reward at each step side by side.
TRL's second generation path on transformers (`use_transformers_continuous_batching`) runs as `trl-hf-cb`.
Writes results/race-<date>.json. Run it with `bash benchmarks/trl_race/run.sh` (which makes the venv).

`--workload` picks the work (`WORKLOADS`: the main job's calculator; `wide`, which the project did not tune
for when it was made (it has been profiled since): three-step expressions up to 60, 4 samples of twice as many
prompts, 4 assistant turns of 96 tokens at temperature 1, another data seed; `long`, added 2026-12-06 and never
profiled: one-step expressions up to 99 with no worked example in the prompt, 8 samples of 2 prompts, up to 2
assistant turns of 160 tokens at temperature 0.7, a third data seed: fewer, longer turns from shorter prompts;
`long-tools`: the same with the worked example).
`--fp32` runs both sides in float32 (engine and training; TRL without bf16 autocast), as the independent race did.
`--trl-retain-heap` runs TRL with glibc's malloc keeping freed memory, as turnrl's CPU trainer has it (by default
TRL faults its activations in again every step: 30-42 s of system time in a 72 s `long` step on this VM).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from turnrl.train.host_memory import KEEP_TOP_BYTES, MMAP_FROM_BYTES

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CONFIG = "examples/calculator/train.yaml"
# overrides of CONFIG (both sides get them) and the prompts per step that make 16 trajectories a step
WORKLOADS: dict[str, tuple[list[str], int]] = {
    "calculator": ([], 2),
    "wide": (["data.train.seed=7", "data.train.options.steps=3", "data.train.options.max_value=60", "rollout.n=4",
              "rollout.max_assistant_turns=4", "rollout.max_response_tokens=300",
              "rollout.sampling.max_tokens_per_turn=96", "rollout.sampling.temperature=1.0"], 4),
    "long": (["data.train.seed=23", "data.train.options.steps=1", "data.train.options.max_value=99",
              "data.train.options.demo=false", "rollout.max_assistant_turns=2", "rollout.max_response_tokens=320",
              "rollout.sampling.max_tokens_per_turn=160", "rollout.sampling.temperature=0.7"], 2)}
# `long` with the worked example back in the prompt: SmolLM2 calls the tool there (without it, never: every
# `long` trajectory was one turn with reward 0 on both sides, a single-turn race)
WORKLOADS["long-tools"] = ([o for o in WORKLOADS["long"][0] if o != "data.train.options.demo=false"], 2)
FP32 = ["engine.dtype=float32", "trainer.dtype=float32"]


# glibc's malloc told through its tunables what turnrl tells it with mallopt (turnrl/train/host_memory.py):
# keep freed memory instead of handing it back and faulting it in again on the next step
RETAIN_HEAP_ENV = {"GLIBC_TUNABLES": f"glibc.malloc.mmap_threshold={MMAP_FROM_BYTES}:"
                                     f"glibc.malloc.trim_threshold={KEEP_TOP_BYTES}"}


def run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[int, float]:
    print(f"[race] {' '.join(cmd)}  (log: {log}){' env ' + str(env) if env else ''}", flush=True)
    start = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, **env} if env else None).returncode
    return code, time.perf_counter() - start


def tail(log: Path, lines: int = 25) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def turnrl_arm(engine: str, steps: int, out: Path, overrides: list[str]) -> dict[str, Any]:
    path, log = out / f"turnrl-{engine}.json", out / f"turnrl-{engine}.log"
    code, wall = run([sys.executable, "-m", "turnrl", "bench", "step", CONFIG, f"engine.kind={engine}", *overrides,
                      "--steps", str(steps), "--warmup", "0", "--json", str(path)], log)
    if code != 0:
        return {"framework": "turnrl", "engine": engine, "ok": False, "wall_s": wall, "error": tail(log)}
    report = json.loads(path.read_text())
    runs = []
    for r in report["runs"]:
        e = r["engine_stats"]
        runs.append({"step": r["step"], "step_s": r["step_s"], "cpu_s": r["cpu_s"], "sys_s": r.get("sys_s"),
                     "minor_faults": r.get("minor_faults"), "rollout_s": r["rollout_s"],
                     "reward_s": r["reward_s"], "tools_s_sum": r["tools_s_sum"],
                     "train_padding_fraction": r["train_padding_fraction"],
                     "train_s": r["logprob_s"] + r["update_s"], "sync_s": r["sync_s"], "other_s": r["other_s"],
                     "trajectories": r["trajectories"], "trajectories_per_s": r["trajectories_per_s"],
                     "generate_calls": e.get("requests"), "generated_tokens": e.get("generated_tokens"),
                     "decode_steps": e.get("decode_steps"), "reward_mean": r["reward_mean"],
                     "response_tokens_mean": r["response_tokens_mean"], "turns_mean": r["turns_mean"],
                     "tool_calls": r["tool_calls"], "loadavg_1m": r["loadavg_1m"], "uids": r.get("uids")})
    return {"framework": "turnrl", "engine": engine, "ok": True, "wall_s": wall, "setup_s": report["setup_s"],
            "runs": runs, "report": report}


def trl_arm(engine: str, steps: int, out: Path, overrides: list[str], continuous_batching: bool = False,
            retain_heap: bool = False) -> dict[str, Any]:
    name = f"trl-{engine}{'-cb' if continuous_batching else ''}"
    path, log = out / f"{name}.json", out / f"{name}.log"
    cmd = [sys.executable, str(HERE / "trl_arm.py"), "--engine", engine, "--steps", str(steps), "--json", str(path),
           "--set", *overrides]
    code, wall = run(cmd + (["--continuous-batching"] if continuous_batching else []), log,
                     RETAIN_HEAP_ENV if retain_heap else None)
    if code != 0:
        return {"framework": "trl", "engine": engine, "ok": False, "wall_s": wall, "error": tail(log),
                "continuous_batching": continuous_batching}
    report = json.loads(path.read_text())
    return {"framework": "trl", "engine": engine, "ok": True, "wall_s": wall, "setup_s": report["setup_s"],
            "runs": report["runs"], "report": report, "continuous_batching": continuous_batching}


def median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(arm: dict[str, Any]) -> dict[str, Any]:
    if not arm["ok"]:
        return {"ok": False}
    runs = arm["runs"]
    keys = ["step_s", "cpu_s", "rollout_s", "train_s", "sync_s", "trajectories_per_s", "generate_calls",
            "reward_mean", "response_tokens_mean", "train_padding_fraction"]
    out = {k: median(runs, k) for k in keys}
    out.update({"ok": True, "total_s": sum(r["step_s"] for r in runs), "reward_last_step": runs[-1]["reward_mean"],
                "reward_by_step": [r["reward_mean"] for r in runs], "step_s_by_step": [r["step_s"] for r in runs],
                "sys_s_by_step": [r.get("sys_s") for r in runs], "setup_s": arm["setup_s"],
                # every arm's first step(s) grow its heap; on this project's VM, memory beyond a process's first
                # ~5 GB faults in at ~14 us a page (README "The race"): the median without the first step too
                "step_s_after_first": median(runs[1:], "step_s") if len(runs) > 1 else None})
    return out


def table(arms: list[dict[str, Any]]) -> str:
    def fmt(v: Any, spec: str = ".2f") -> str:
        return "-" if v is None else format(v, spec)
    lines = [f"{'arm':<14} {'step s':>7} {'w/o 1st':>7} {'cpu s':>6} {'traj/s':>7} {'rollout s':>9} {'train s':>8} "
             f"{'sync s':>7} {'gen calls':>9} {'resp tok':>8} {'reward/step':>18} {'setup s':>7}"]
    for arm in arms:
        label = f"{arm['framework']}-{arm['engine']}{'-cb' if arm.get('continuous_batching') else ''}"
        s = arm["summary"]
        if not s["ok"]:
            lines.append(f"{label:<14} failed: see {label}.log / the JSON's error")
            continue
        rewards = " ".join(fmt(x, ".3f") for x in s["reward_by_step"])
        lines.append(f"{label:<14} {fmt(s['step_s']):>7} {fmt(s['step_s_after_first']):>7} "
                     f"{fmt(s['cpu_s'], '.1f'):>6} {fmt(s['trajectories_per_s'], '.3f'):>7} "
                     f"{fmt(s['rollout_s']):>9} {fmt(s['train_s']):>8} {fmt(s['sync_s']):>7} "
                     f"{fmt(s['generate_calls'], '.0f'):>9} {fmt(s['response_tokens_mean'], '.1f'):>8} "
                     f"{rewards:>18} {fmt(s['setup_s'], '.1f'):>7}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--engines", default="hf,vllm", help="comma-separated: hf, vllm")
    p.add_argument("--prompts", type=int, default=None,
                   help="prompts per step, both sides (default: the workload's, 16 trajectories a step)")
    p.add_argument("--workload", default="calculator", choices=sorted(WORKLOADS))
    p.add_argument("--fp32", action="store_true", help="float32 on both sides (default: each side's CPU default, "
                   "bf16 where the CPU has it)")
    p.add_argument("--skip-trl-cb", action="store_true",
                   help="leave out TRL with use_transformers_continuous_batching (its other hf generation path)")
    p.add_argument("--trl-retain-heap", action="store_true",
                   help="run TRL with glibc's malloc keeping freed memory (GLIBC_TUNABLES; what turnrl's CPU trainer "
                   "sets with mallopt): TRL without the page faults it pays each step by default")
    p.add_argument("--out", default=None, help="results JSON (default: results/race-<date>.json)")
    a = p.parse_args()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
    out_json = Path(a.out) if a.out else HERE / "results" / f"race-{stamp}.json"
    work = HERE / "runs" / stamp
    work.mkdir(parents=True, exist_ok=True)
    workload, prompts = WORKLOADS[a.workload]
    overrides = [*workload, f"data.prompts_per_step={a.prompts or prompts}", *(FP32 if a.fp32 else [])]
    arms = []
    for engine in a.engines.split(","):
        arms.append(turnrl_arm(engine, a.steps, work, overrides))
        arms.append(trl_arm(engine, a.steps, work, overrides, retain_heap=a.trl_retain_heap))
        if engine == "hf" and not a.skip_trl_cb:
            arms.append(trl_arm(engine, a.steps, work, overrides, continuous_batching=True,
                                retain_heap=a.trl_retain_heap))
    for arm in arms:
        arm["summary"] = summarize(arm)
    speedups = {}
    trl_ok = [x for x in arms if x["framework"] == "trl" and x["summary"]["ok"]]
    best = min(trl_ok, key=lambda x: x["summary"]["step_s"]) if trl_ok else None
    for engine in a.engines.split(","):
        ours = next(x for x in arms if x["framework"] == "turnrl" and x["engine"] == engine)["summary"]
        theirs = next(x for x in arms if x["framework"] == "trl" and x["engine"] == engine
                      and not x.get("continuous_batching"))
        for name, other in ((engine, theirs), (f"{engine}_vs_trl_fastest", best)):
            if name != engine and other is theirs:
                continue   # the fastest TRL arm is this engine's own
            if ours["ok"] and other is not None and other["summary"]["ok"]:
                o = other["summary"]
                after = (o["step_s_after_first"] / ours["step_s_after_first"]
                         if o["step_s_after_first"] and ours["step_s_after_first"] else None)
                speedups[name] = {"step_time": o["step_s"] / ours["step_s"], "step_time_after_first": after,
                                  "cpu_time": o["cpu_s"] / ours["cpu_s"],
                                  "trajectories_per_s": ours["trajectories_per_s"] / o["trajectories_per_s"],
                                  "trl_arm": f"{other['framework']}-{other['engine']}"
                                             f"{'-cb' if other.get('continuous_batching') else ''}"}
    ref = next((x for x in arms if x["framework"] == "turnrl" and x["summary"]["ok"]), None)
    for arm in arms:   # every arm saw the same tasks at every step
        if arm["summary"]["ok"] and ref is not None:
            arm["summary"]["same_tasks_as_turnrl"] = all(
                set(r.get("uids") or []) == set(q.get("uids") or []) for r, q in zip(arm["runs"], ref["runs"]))
    from turnrl.bench.common import machine_info
    result = {"benchmark": "trl_race", "steps": a.steps, "config": CONFIG, "workload": a.workload, "fp32": a.fp32,
              "trl_env": RETAIN_HEAP_ENV if a.trl_retain_heap else {},
              "overrides": overrides,
              "speedup_turnrl_over_trl": speedups,
              "arms": [{k: v for k, v in arm.items() if k != "report"} for arm in arms],
              "details": {f"{arm['framework']}-{arm['engine']}{'-cb' if arm.get('continuous_batching') else ''}":
                          arm.get("report") for arm in arms}, "machine": machine_info()}
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=1, default=str))
    print(table(arms))
    for name, s in speedups.items():
        after = f", {s['step_time_after_first']:.2f}x without step 1" if s["step_time_after_first"] else ""
        print(f"turnrl-{name.split('_')[0]} vs {s['trl_arm']}: {s['step_time']:.2f}x faster per step "
              f"({s['cpu_time']:.2f}x less CPU time), {s['trajectories_per_s']:.2f}x trajectories/s "
              f"(medians over {a.steps} steps{after})")
    print(f"wrote {out_json} (logs in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
