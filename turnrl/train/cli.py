"""`turnrl train` and `turnrl eval`."""

from __future__ import annotations

import argparse
import asyncio
import json

from turnrl.cli import _config_args, command
from turnrl.config import load_config


def _eval_args(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the base model)")


@command("train", "run RL training: rollout -> rewards -> advantages -> update -> sync", _config_args)
def cmd_train(a: argparse.Namespace) -> int:
    cfg = load_config(a.config, a.overrides)
    if cfg.trainer.placement == "local":
        from turnrl.train.trainer import Trainer
        history = asyncio.run(Trainer(cfg).run())
    elif cfg.agent is not None:
        raise SystemExit("error: 'agent:' rollouts run in the local trainer only: set trainer.placement=local")
    else:  # engines and training ranks as Ray actors
        from turnrl.distributed.trainer import DistributedTrainer
        history = asyncio.run(DistributedTrainer(cfg).run())
    scored = [h["reward/mean"] for h in history if "reward/mean" in h]   # steps with every trajectory masked have none
    if scored:
        n = max(1, len(scored) // 4)
        print(f"reward/mean: first quarter {sum(scored[:n]) / n:.3f} -> last quarter {sum(scored[-n:]) / n:.3f} "
              f"({len(scored)} of {len(history)} steps scored; metrics in {cfg.output_dir}/metrics.jsonl)")
    elif history:
        print(f"no step had a scored trajectory: no reward was measured (see {cfg.output_dir}/trajectories.jsonl)")
    return 0


@command("eval", "evaluate a checkpoint on the eval set (greedy)", _eval_args)
def cmd_eval(a: argparse.Namespace) -> int:
    from turnrl.train.evaluate import evaluate_checkpoint
    cfg = load_config(a.config, a.overrides)
    print(json.dumps(asyncio.run(evaluate_checkpoint(cfg, a.checkpoint)), indent=2))
    return 0


@command("sft", "supervised fine-tuning on conversations (or rejection-sampling rounds)", _config_args)
def cmd_sft(a: argparse.Namespace) -> int:
    from turnrl.train.sft_run import SFTRun
    cfg = load_config(a.config, a.overrides)
    history = asyncio.run(SFTRun(cfg).run())
    if history and "sft/loss" in history[0]:
        print(f"sft/loss: first {history[0]['sft/loss']:.3f} -> last {history[-1]['sft/loss']:.3f}")
    return 0
