"""`turnrl verl`: run a verl command line on turnrl.

    turnrl verl algorithm.adv_estimator=grpo data.train_files=train.parquet ... [--set turnrl.key=value ...]

The verl keys (with or without hydra's `+`) are translated by `turnrl.compat.verl_cli`; the translation table
is printed, then the run starts (`--dry-run`: the resolved turnrl config is printed instead). `--set` takes
turnrl's own dotted keys, applied after the translation (e.g. to point the judge at a local model).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
from pathlib import Path

from turnrl.cli import command
from turnrl.config import ConfigError, dump_yaml


def _verl_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="verl overrides as given to verl.trainer.main_ppo (a leading + is fine; $VARS are expanded)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="turnrl",
                   help="a turnrl override applied after the translation (repeatable), e.g. "
                        "--set reward.judge.llm.backend=local")
    p.add_argument("--allow-unknown", action="store_true",
                   help="proceed past verl keys turnrl does not know (they are still listed, as ignored)")
    p.add_argument("--dry-run", action="store_true", help="print the table and the resolved turnrl config; no run")
    p.add_argument("--list-keys", action="store_true", help="print every verl key turnrl knows (Markdown) and exit")


@command("verl", "run a verl main_ppo command line (key=value ...) on turnrl, with a translation table", _verl_args)
def cmd_verl(a: argparse.Namespace) -> int:
    from turnrl.compat.verl_cli import check_prompts, check_rewards, error_summary, format_table, key_table, translate
    if a.list_keys:
        print(key_table())
        return 0
    if not a.overrides:
        raise ConfigError("give verl overrides (key=value ...), or --list-keys to see the keys turnrl knows.")
    t = translate(a.overrides, allow_unknown=a.allow_unknown)
    cfg, problem = None, None
    if not t.errors:
        try:
            cfg = t.config(a.turnrl)
            check_rewards(cfg)
            _check_sinks(cfg.logging.sinks)
        except ConfigError as exc:
            problem = exc
    print(format_table(t, a.turnrl), flush=True)
    if t.errors:
        raise ConfigError(error_summary(t))
    if problem is not None:
        raise problem
    if a.dry_run:
        print(dump_yaml(cfg), end="")
        return 0
    mode, max_prompt = t.prompt_check()
    report, kept = check_prompts(cfg, max_prompt, mode, Path(cfg.output_dir))
    steps = t.steps_for(kept) if kept is not None else None
    if steps is not None:
        cfg.trainer.steps = steps
        report.append(f"trainer.steps recounted from the kept rows: {steps}")
    print("\n".join(report), flush=True)
    if cfg.trainer.placement == "local":
        from turnrl.train.trainer import Trainer
        history = asyncio.run(Trainer(cfg).run())
    else:  # verl's multi-GPU command lines: engines and training ranks as Ray actors
        from turnrl.distributed.trainer import DistributedTrainer
        history = asyncio.run(DistributedTrainer(cfg).run())
    if history:
        scored = [h["reward/mean"] for h in history if "reward/mean" in h] or [float("nan")]
        print(f"reward/mean: first scored step {scored[0]:.3f} -> last {scored[-1]:.3f}; "
              f"turns/mean {sum(h['turns/mean'] for h in history) / len(history):.2f} "
              f"(metrics in {cfg.output_dir}/metrics.jsonl)")
    return 0


SINK_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}


def _check_sinks(sinks: list[str]) -> None:
    """Before the model loads: a logger whose package is missing fails now, not after minutes of setup."""
    missing = [s for s in sinks if s in SINK_PACKAGES and importlib.util.find_spec(SINK_PACKAGES[s]) is None]
    if missing:
        raise ConfigError(f"trainer.logger / logging.sinks has {missing}, not installed here: pip install "
                          f"{' '.join(SINK_PACKAGES[s] for s in missing)}, or log to console "
                          "(--set logging.sinks=[console]).")
