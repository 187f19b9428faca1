"""`turnrl serve`: the gateway over a config's engine, or over a trained run's weights (full or LoRA).

`turnrl serve CFG` serves the config's model on its engine (hf or vllm). `turnrl serve RUN_DIR` reads the run's
`config.yaml` and loads its latest checkpoint (or `--checkpoint DIR`): full weights, or the LoRA adapter merged
into the base weights, copied into the engine in place as the trainer's weight sync does. Sampling defaults,
context length, tool parser and `on_mismatch` come from the config's `rollout` section; with `--record DIR`
every session closed over HTTP is appended to `DIR/trajectories.jsonl` (`turnrl view DIR`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.chat.detect import parser_for
from turnrl.config import Config, load_config
from turnrl.engines.base import Engine
from turnrl.gateway.service import Defaults, Gateway
from turnrl.models import resolve
from turnrl.rollout.factory import build_engine, load_template


@dataclass
class Served:
    cfg: Config
    model_name: str
    checkpoint: Path | None


def resolve_target(target: str, overrides: list[str], checkpoint: str | None, model_name: str | None) -> Served:
    """A config file or a run directory (its config.yaml, its latest checkpoint) -> what to serve."""
    path = Path(target)
    run_dir = path if path.is_dir() else None
    if run_dir is not None:
        if not (run_dir / "config.yaml").is_file():
            raise ValueError(f"{run_dir} is a directory without config.yaml: give a config file or a turnrl run "
                             "directory (one that `turnrl train` wrote).")
        cfg = load_config(str(run_dir / "config.yaml"), overrides)
    else:
        cfg = load_config(target, overrides)
    ckpt = None
    if checkpoint is not None or run_dir is not None:
        from turnrl.train.checkpoint import find_checkpoint
        root = (run_dir or Path(cfg.output_dir)) / "checkpoints"
        ckpt = find_checkpoint(checkpoint or "latest", root)
    name = model_name or (f"{run_dir.name}" if run_dir is not None else cfg.model.name)
    return Served(cfg, name, ckpt)


def defaults_from(cfg: Config) -> Defaults:
    s = cfg.rollout.sampling
    return Defaults(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens_per_turn,
                    max_context=min(cfg.rollout.max_context_tokens, cfg.engine.max_model_len), seed=cfg.seed)


async def load_checkpoint_into(engine: Engine, cfg: Config, model_dir: Path, checkpoint: Path) -> int:
    """Copy a checkpoint's weights into the engine (LoRA merged into the base weights); returns its step."""
    import torch

    from turnrl.train.checkpoint import load_model_weights, read_state
    from turnrl.train.policy import export_weights, load_policy
    lora = cfg.model.lora
    policy = load_policy(str(model_dir), torch.device("cpu"), lora.rank, lora.alpha, lora.dropout, lora.target_modules)
    load_model_weights(policy, checkpoint)
    await engine.update_weights(export_weights(policy), 0)
    return int(read_state(checkpoint)["step"])


async def build_gateway(served: Served) -> tuple[Gateway, Engine]:
    cfg = served.cfg
    model_dir = resolve(cfg.model.name)
    template = load_template(model_dir, cfg.model.chat_template, cfg.model.chat_template_kwargs)
    engine = build_engine(cfg.engine, model_dir)
    if served.checkpoint is not None:
        step = await load_checkpoint_into(engine, cfg, model_dir, served.checkpoint)
        print(f"[turnrl] serving {served.checkpoint} (step {step})", flush=True)
    gateway = Gateway(engine, template, parser_for(cfg.rollout.tool_parser, template), [served.model_name], defaults_from(cfg),
                      cfg.rollout.on_mismatch)
    return gateway, engine


def recorder(out: Path | None) -> Any:
    if out is None:
        return None
    from turnrl.observe.store import write_trajectories
    out.mkdir(parents=True, exist_ok=True)
    return lambda traj: write_trajectories(out / "trajectories.jsonl", [traj], append=True, step=0, split="gateway")
