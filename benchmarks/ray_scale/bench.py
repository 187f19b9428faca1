"""Ray scale-out benchmark on a 2-GPU machine: split placement, FSDP2 scaling, async vs sync.

    python benchmarks/ray_scale/bench.py --tokenizer DIR --out DIR     (benchmarks/ray_scale/run_gpu.sh runs it)

Phases (each prints its figures; all go to OUT/ray_scale.json, and a table at the end):
- scaling: the same synthetic batch (128 rows of 512-1024 tokens, loss on their second half) updated by 1 FSDP2
  rank on one GPU and by 2 ranks on two GPUs (NCCL): step time, tokens/s, scaling = tps(2) / (2 x tps(1)). Check:
  the first update's objective agrees between 1 and 2 ranks (bf16 autocast: to about 1e-2).
- split_sync / split_async / split_partial: the RL loop with `trainer.placement=split`: one hf-engine replica on GPU 0, one
  training rank on GPU 1, weights over NCCL broadcast. The work is multi-turn: each row's simulated user ends
  the conversation after k turns, k drawn from 1..6 with P(k) ~ 2^-k (most are short, a few are long: the
  stragglers that a synchronous step waits for). Same rows, seeds and sizes for all; async uses
  max_staleness=1 and algo.tis_cap=2; partial is async with `engine.partial_rollout` (weight syncs interrupt
  the requests in flight, which resume on the new weights); carry is partial with `trainer.carry_over=1` (a batch
  closes at prompts_per_step finished groups, the rest run on into the next batch). `--user-delay S` makes each
  simulated-user reply take S seconds, so long conversations are slow even on a CPU. Step time is the mean over all steps but the first (warm-up). Checks:
  the engine holds the trainer's weights after the last sync, every trajectory stayed on one replica, and no
  batch was staler than max_staleness.

The model is random (no download): Qwen2.5-0.5B's shape (24 layers, hidden 896, MLP 4864, 14/2 heads, tied
embeddings; 402M parameters) with the vocabulary of the SmolLM2 tokenizer that `--tokenizer` points to (49152:
a sampled id must decode), `--model tiny`: a 2-layer one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve()
SHAPES = {
    # Qwen2.5-0.5B's body; the vocabulary is the tokenizer's (ids past it could not be decoded): 402M parameters
    "qwen2.5-0.5b": dict(vocab_size=49152, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "tiny": dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}


# -- the environment of the RL phases (run on the driver) --------------------------------------------------
class RandomTurns:
    """A simulated user that says 'Go on.' until the row's number of turns is reached, each reply after the
    row's `delay` seconds (a user model or tool that takes time; the event loop runs on meanwhile)."""

    def start(self, turns: int = 1, delay: float = 0.0, **_: Any) -> None:
        self.left, self.replies, self.delay = int(turns), 0, float(delay)

    async def respond(self, messages: list[dict[str, Any]]) -> Any:
        from turnrl.env.interactions import Reply
        self.left -= 1
        self.replies += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        return Reply("Go on.", done=self.left <= 0)

    def finish(self) -> float:
        return 0.0


def reward(traj: Any) -> float:
    """Varies with any output, so GRPO has advantages to train on."""
    text = "".join(m["content"] for m in traj.messages if m["role"] == "assistant")
    return (len(text) % 5) / 4.0


def write_rows(path: Path, n: int, seed: int, delay: float = 0.0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            turns = min(6, 1 + int(rng.expovariate(0.693)))   # P(k) ~ 2^-k, capped at 6
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Tell me a story, part {i}."}],
                                "interaction": {"name": "turns", "turns": turns, "delay": delay}}) + "\n")


def build_model(out: Path, tokenizer_dir: Path, shape: str) -> Path:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    target = out / f"model-{shape}"
    if (target / "config.json").is_file():
        return target
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=8192, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(target), safe_serialization=True)
    tok.save_pretrained(str(target))
    for extra in ("chat_template.jinja",):
        if (tokenizer_dir / extra).is_file() and not (target / extra).is_file():
            shutil.copy(tokenizer_dir / extra, target / extra)
    return target


# -- phase: FSDP2 scaling ------------------------------------------------------------------------------------
def synthetic_rows(rows: int, lo: int, hi: int, vocab: int, seed: int) -> Any:
    from turnrl.train.batching import Rows
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (rows,), generator=g)
    width = int(lengths.max())
    ids = torch.randint(3, min(vocab, 49152), (rows, width), generator=g)
    attn = (torch.arange(width)[None, :] < lengths[:, None]).long()
    pos = (attn.cumsum(1) - 1).clamp(min=0) * attn
    loss = ((torch.arange(width)[None, :] >= (lengths // 2)[:, None]) & (attn > 0)).float()
    adv = torch.where(torch.rand(rows, 1, generator=g) > 0.5, 1.0, -1.0) * loss
    lp = -torch.rand(rows, width, generator=g) * 3 * loss
    return Rows(ids * attn, attn, pos, loss, lp.clone(), lp, adv)


async def scaling_phase(ray: Any, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from ray.util.placement_group import placement_group, remove_placement_group

    from turnrl.config.schema import OptimConfig
    from turnrl.distributed import placement as place
    from turnrl.distributed.balance import plan_mini
    from turnrl.distributed.ranks import RankGroup, RankSpec, TrainRank, merge_updates
    from turnrl.train.update import UpdateSettings
    rows = synthetic_rows(args.rows, 512, 1024, SHAPES[args.model]["vocab_size"], 0)
    tokens = int(rows.attention_mask.sum())
    out: dict[str, Any] = {"rows": args.rows, "tokens_per_step": tokens, "micro_batch_tokens": args.micro_tokens}
    settings = UpdateSettings(micro_batch_tokens=args.micro_tokens, grad_clip=1.0)
    gpu = not args.cpu
    spec = RankSpec(str(model_dir), 0, 32.0, 0.0, "all-linear", False, OptimConfig(lr=1e-6), 100, settings,
                    "auto" if gpu else "float32", "bfloat16", 0, gpu, 0 if gpu else 1)
    resources = {"num_gpus": 1, "num_cpus": 2} if gpu else {"num_cpus": 1}
    for world in (1, 2):
        group = placement_group([{"GPU": 1, "CPU": 2} if gpu else {"CPU": 1}] * world, strategy="PACK")
        await group.ready()
        cls = ray.remote(TrainRank)
        ranks = RankGroup([cls.options(**place.actor_options(group, r, resources)).remote(r, world, spec)
                           for r in range(world)])
        try:
            t0 = time.perf_counter()
            await ranks.setup()
            setup_s = time.perf_counter() - t0
            ref = ray.put(rows)
            mini = plan_mini(torch.arange(args.rows), rows.lengths, rows.loss_mask, world, args.micro_tokens, False)
            plans = [[(mini.normalizer, mini.micro[r])] for r in range(world)]
            times, objective = [], None
            for i in range(1 + args.scaling_steps):
                t0 = time.perf_counter()
                result = merge_updates(await ranks.update(ref, plans), world)
                times.append(time.perf_counter() - t0)
                objective = result["loss/objective"] if objective is None else objective
            step = sum(times[1:]) / len(times[1:])
            out[f"ranks{world}"] = {"setup_s": setup_s, "step_s": step, "tokens_per_s": tokens / step,
                                    "first_step_s": times[0], "first_objective": objective}
            print(f"[scaling] {world} rank(s): {step:.3f} s/step, {tokens / step:,.0f} tokens/s", flush=True)
        finally:
            for a in ranks.actors:
                ray.kill(a)
            remove_placement_group(group)
    one, two = out["ranks1"], out["ranks2"]
    out["speedup"] = two["tokens_per_s"] / one["tokens_per_s"]
    out["scaling_efficiency"] = out["speedup"] / 2
    out["objective_rel_diff"] = abs(two["first_objective"] - one["first_objective"]) / max(
        abs(one["first_objective"]), 1e-9)
    return out


# -- phase: the RL loop on split placement -------------------------------------------------------------------
def rl_config(out: Path, model_dir: Path, data: Path, args: argparse.Namespace, mode: str, sync: str) -> Any:
    from turnrl.config import load_config
    cfg_file = out / f"{mode}.yaml"
    cfg_file.write_text(json.dumps({
        "model": {"name": str(model_dir)},
        "engine": {"kind": "hf", "dtype": "float32" if args.cpu else "auto", "max_batch_size": 256, "gather_ms": 2.0,
                   "max_model_len": 1024, "fast": args.fast, "partial_rollout": mode in ("partial", "carry")},
        "rollout": {"n": args.n, "max_assistant_turns": 8, "max_user_turns": 8, "max_response_tokens": 4096,
                    "max_context_tokens": 8192, "concurrency": 1024,
                    "sampling": {"max_tokens_per_turn": args.max_tokens},
                    "interactions": [{"name": "turns", "class_name": f"{HERE}:RandomTurns"}]},
        "data": {"train": {"path": str(data)}, "prompts_per_step": args.prompts, "shuffle": False},
        "reward": {"functions": [f"{HERE}:reward"]},
        "algo": {"tis_cap": 2.0},
        "trainer": {"steps": args.steps, "placement": "split", "gpus_per_node": 0 if args.cpu else 2, "ranks": 1,
                    "dtype": "float32" if args.cpu else "auto",
                    "micro_batch_tokens": args.micro_tokens, "optim": {"lr": 1e-6}, "save_every": 0,
                    "keep_checkpoints": 1, "trajectories_per_step_saved": 0, "weight_sync": sync,
                    "async_rollout": mode in ("async", "partial", "carry"), "max_staleness": 1,
                    "carry_over": 1 if mode == "carry" else 0},
        "logging": {"sinks": [], "progress": "off"},
        "output_dir": str(out / f"run-{mode}")}))
    return load_config(str(cfg_file), [])


async def rl_phase(model_dir: Path, data: Path, args: argparse.Namespace, mode: str, sync: str) -> dict[str, Any]:
    from turnrl.distributed.trainer import DistributedTrainer
    cfg = rl_config(args.out, model_dir, data, args, mode, sync)
    trainer = DistributedTrainer(cfg)
    close, trainer.close = trainer.close, _nothing
    trajectories: list[Any] = []
    train_on = trainer.train_on

    async def keep(step: int, rollout: Any) -> dict[str, Any]:
        trajectories.extend(rollout.trajectories)
        return await train_on(step, rollout)
    trainer.train_on = keep
    t0 = time.perf_counter()
    try:
        await trainer.start()
        setup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        history = await trainer.run()
        run_s = time.perf_counter() - t0
        engine = await trainer.pool.replicas[0].handle.fingerprint.remote()
        rank = await trainer.ranks.actors[0].fingerprint.remote()
    finally:
        await close()
    timed = history[1:] or history

    def mean(key: str) -> float:
        values = [m[key] for m in timed if key in m]
        return sum(values) / len(values) if values else float("nan")
    worst = max(abs(engine[n] - v) / max(abs(v), 1.0) for n, v in rank.items())
    sticky = all(len(set(t.metrics.get("replicas", []))) <= 1 for t in trajectories)
    policy_tokens = sum(m["response_tokens/mean"] * m["trajectories"] for m in timed)
    out = {"mode": mode, "weight_sync": trainer.sync.transport, "steps": len(history), "setup_s": setup_s,
           "run_s": run_s, "step_s": mean("time/step_s"), "rollout_s": mean("time/rollout_s"),
           "wait_rollout_s": mean("time/wait_rollout_s"), "update_s": mean("time/update_s"),
           "sync_s": mean("time/sync_s"), "rollout_tokens_per_s": mean("throughput/tokens_per_s"),
           "train_tokens_per_s": mean("throughput/train_tokens_per_s"),
           "policy_tokens_per_step_s": policy_tokens / max(sum(m["time/step_s"] for m in timed), 1e-9),
           "straggler_tail_frac": mean("straggler/tail_frac"), "straggler_last_s": mean("straggler/last_s"),
           "straggler_p50_s": mean("straggler/p50_s"), "turns_mean": mean("turns/mean"),
           "max_staleness_seen": max(m["async/staleness"] for m in history),
           "token_staleness_mean": mean("staleness/token_mean"),
           "interrupted_turns_per_step": mean("partial/interrupted_turns"),
           "carried_groups_per_step": mean("carry/groups_in"),
           "checks": {"engine_matches_trainer_rel": worst, "sticky": sticky,
                      "trajectories": len(trajectories)},
           "per_step": [{k: v for k, v in m.items()
                         if k.startswith(("time/", "throughput/", "straggler/", "async/", "staleness/", "partial/",
                                                         "carry/"))}
                        for m in history]}
    print(f"[{mode}] {out['step_s']:.2f} s/step (rollout {out['rollout_s']:.2f}, wait {out['wait_rollout_s']:.2f}, "
          f"update {out['update_s']:.2f}, sync {out['sync_s']:.2f}); weights {out['weight_sync']}", flush=True)
    return out


async def _nothing() -> None:
    pass


def table(report: dict[str, Any]) -> str:
    lines = ["| figure | value |", "|---|---|"]
    s = report.get("scaling")
    if s:
        lines += [f"| FSDP2 1 GPU: step / tokens/s | {s['ranks1']['step_s']:.3f} s / {s['ranks1']['tokens_per_s']:,.0f} |",
                  f"| FSDP2 2 GPUs: step / tokens/s | {s['ranks2']['step_s']:.3f} s / {s['ranks2']['tokens_per_s']:,.0f} |",
                  f"| scaling (2 GPUs vs 1) | {s['speedup']:.2f}x ({100 * s['scaling_efficiency']:.0f}% efficiency) |"]
    for mode in ("sync", "async", "partial", "carry"):
        r = report.get(f"split_{mode}")
        if r:
            lines += [f"| split {mode}: step time | {r['step_s']:.2f} s (rollout {r['rollout_s']:.2f}, trainer waits "
                      f"{r['wait_rollout_s']:.2f}, update {r['update_s']:.2f}, sync {r['sync_s']:.2f}) |",
                      f"| split {mode}: policy tokens/s per step | {r['policy_tokens_per_step_s']:,.0f} |",
                      f"| split {mode}: straggler tail (last - p50) / last | {r['straggler_tail_frac']:.2f} |"]
            if mode in ("partial", "carry"):
                lines.append(f"| split {mode}: interrupted turns per step, token staleness | "
                             f"{r['interrupted_turns_per_step']:.1f}, {r['token_staleness_mean']:.2f} |")
            if mode == "carry":
                lines.append(f"| split carry: groups carried into a later batch per step | "
                             f"{r['carried_groups_per_step']:.2f} |")
    for mode in ("async", "partial", "carry"):
        if report.get("split_sync") and report.get(f"split_{mode}"):
            lines.append(f"| {mode} vs sync step time | "
                         f"{report['split_sync']['step_s'] / report[f'split_{mode}']['step_s']:.2f}x |")
    return "\n".join(lines)


def checks(report: dict[str, Any], max_staleness: int) -> dict[str, bool]:
    out = {}
    if "scaling" in report:
        out["fsdp_1_vs_2_objective_agrees"] = report["scaling"]["objective_rel_diff"] < 2e-2
    for mode in ("sync", "async", "partial", "carry"):
        r = report.get(f"split_{mode}")
        if r:
            out[f"{mode}_engine_holds_trainer_weights"] = r["checks"]["engine_matches_trainer_rel"] < 1e-2
            out[f"{mode}_trajectories_sticky"] = r["checks"]["sticky"]
            bound = {"sync": 0, "carry": max_staleness + 1}.get(mode, max_staleness)   # carry_over=1
            out[f"{mode}_staleness_bounded"] = r["max_staleness_seen"] <= bound
    return out


async def main(args: argparse.Namespace) -> int:
    import ray
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"command": " ".join(sys.argv), "python": platform.python_version(),
                              "torch": torch.__version__, "ray": ray.__version__,
                              "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                              "model": args.model, "engine_fast": args.fast, "errors": {}}
    start = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=True)
    model_dir = build_model(args.out, args.tokenizer, args.model)
    data = args.out / "rows.jsonl"
    write_rows(data, args.prompts * args.steps, 0, args.user_delay)
    phases = [p for p in ("scaling", "sync", "async", "partial", "carry") if args.phase in ("all", p)]
    for phase in phases:
        if time.perf_counter() - start > args.budget_s:
            report["errors"][phase] = f"skipped: past the {args.budget_s:.0f} s budget"
            continue
        try:
            if phase == "scaling":
                report["scaling"] = await scaling_phase(ray, model_dir, args)
            else:
                try:
                    report[f"split_{phase}"] = await rl_phase(model_dir, data, args, phase, args.weight_sync)
                except Exception as exc:  # noqa: BLE001 - NCCL broadcast failed: measure the rest anyway
                    if args.weight_sync == "object_store":
                        raise
                    report["errors"][f"{phase}_{args.weight_sync}"] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
                    print(f"[{phase}] weight sync {args.weight_sync} failed; again with object_store", flush=True)
                    report[f"split_{phase}"] = await rl_phase(model_dir, data, args, phase, "object_store")
        except Exception as exc:  # noqa: BLE001 - one phase failing leaves the others' figures
            report["errors"][phase] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        (args.out / "ray_scale.json").write_text(json.dumps(report, indent=2, default=str))
    report["checks"] = checks(report, 1)
    report["total_s"] = time.perf_counter() - start
    (args.out / "ray_scale.json").write_text(json.dumps(report, indent=2, default=str))
    print(table(report))
    print(json.dumps({"checks": report["checks"], "errors": report["errors"], "total_s": report["total_s"]}, indent=2))
    print(f"wrote {args.out / 'ray_scale.json'}")
    return 0 if all(report["checks"].values()) and not any(
        not str(v).startswith("skipped") and k in phases for k, v in report["errors"].items()) else 1


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/ray_scale")))
    p.add_argument("--tokenizer", type=Path, required=True, help="a model dir with the SmolLM2 tokenizer")
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--phase", choices=["all", "scaling", "sync", "async", "partial", "carry"], default="all")
    p.add_argument("--steps", type=int, default=5, help="RL steps per mode (the first is warm-up)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per assistant turn")
    p.add_argument("--rows", type=int, default=128, help="scaling: rows per synthetic batch")
    p.add_argument("--scaling-steps", type=int, default=3)
    p.add_argument("--micro-tokens", type=int, default=16384)
    p.add_argument("--weight-sync", default="broadcast", choices=["broadcast", "object_store"])
    p.add_argument("--fast", choices=["auto", "on", "off"], default="auto",
                   help="engine.fast: turnrl's fast hf engine (auto: on GPUs) or plain transformers decoding")
    p.add_argument("--user-delay", type=float, default=0.0,
                   help="seconds each simulated-user reply takes (the event loop runs on meanwhile)")
    p.add_argument("--cpu", action="store_true", help="a smoke test of this script without GPUs (use --model tiny)")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip phases that would start after this")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
