"""A run directory is one run: a new run never writes into an earlier one, a resumed run is the same run.

Without `trainer.resume`, an `output_dir` that already holds a run (metrics, trajectories or checkpoints) is
refused: writing there would truncate its metrics, append new trajectories after the old ones and move
`latest` back among the old checkpoints. `trainer.overwrite=true` deletes that run's files first (only the
files a run writes, never anything else in the directory). With `trainer.resume`, the checkpoint's saved
config is compared with this one: a change that the saved state cannot take (another model, LoRA vs full
weights or another adapter shape, PPO's critic added or dropped, another optimizer) is refused before anything
loads; any other change (rollout.n, the learning rate, ...) is printed, so that it is a decision, not an accident.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from turnrl.config import Config, ConfigError, to_dict

RUN_FILES = ("metrics.jsonl", "trajectories.jsonl", "tables.jsonl", "checkpoints", "plots", "config.yaml",
             "model", "engine.log")
# Keys whose change the saved state cannot follow (the weights' or the optimizer state's shapes).
FIXED = ("model.name", "model.lora.rank", "model.lora.target_modules", "trainer.optim.name", "algo.advantage")
# Keys that say nothing about what a step computes.
FREE = ("output_dir", "trainer.resume", "trainer.overwrite", "trainer.steps", "trainer.save_every",
        "trainer.keep_checkpoints", "trainer.eval_every", "logging.", "engine.", "rollout.concurrency")


def previous_run(out: Path) -> list[str]:
    """What of an earlier run `out` holds (empty: nothing)."""
    found = [name for name in ("metrics.jsonl", "trajectories.jsonl") if (out / name).is_file()
             and (out / name).stat().st_size > 0]
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.glob("step_*")):
        found.append(f"{len(list(checkpoints.glob('step_*')))} checkpoint(s)")
    return found


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def config_changes(saved: dict[str, Any], cfg: Config) -> dict[str, tuple[Any, Any]]:
    """key -> (saved value, this value) for every key both configs have and that matters to a step."""
    old, new = flat(saved), flat(to_dict(cfg))
    return {k: (old[k], new[k]) for k in sorted(old.keys() & new.keys())
            if old[k] != new[k] and not k.startswith(FREE)}


def saved_config(cfg: Config) -> dict[str, Any] | None:
    from turnrl.train.checkpoint import find_checkpoint, read_state  # torch: only when resuming
    out = Path(cfg.output_dir)
    try:
        path = find_checkpoint(cfg.trainer.resume or "", out / "checkpoints")
    except (ValueError, OSError):
        return None   # the trainer's own resume reports a missing checkpoint
    try:
        return read_state(path).get("config")
    except (OSError, ValueError):
        return None   # a damaged checkpoint: the trainer's resume names the file and the step to use instead


def prepare_run_dir(cfg: Config) -> Path:
    """Check (and with overwrite, clear) `cfg.output_dir` before a run writes into it; returns it, created."""
    out = Path(cfg.output_dir)
    if cfg.trainer.resume:
        saved = saved_config(cfg)
        changes = config_changes(saved, cfg) if saved else {}
        fixed = {k: v for k, v in changes.items() if k.startswith(FIXED)}
        if fixed:
            listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in fixed.items())
            raise ConfigError(f"cannot resume {cfg.trainer.resume!r} in {out}: the checkpoint was trained with "
                              f"another setup ({listed}). Resume with the saved values, or start a new run in a "
                              f"fresh output_dir (trainer.resume unset).")
        if changes:
            listed = "\n".join(f"  {k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
            print(f"[turnrl] resuming with a changed config:\n{listed}", flush=True)
    else:
        found = previous_run(out)
        if found and not cfg.trainer.overwrite:
            raise ConfigError(f"output_dir {out} already holds a run ({', '.join(found)}). Continue it with "
                              f"trainer.resume=latest, start a new one in a fresh output_dir, or set "
                              f"trainer.overwrite=true to delete it and start again.")
        if found:
            for name in RUN_FILES:
                path = out / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                elif path.exists() or path.is_symlink():
                    path.unlink()
            print(f"[turnrl] trainer.overwrite: deleted the earlier run in {out}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    return out
