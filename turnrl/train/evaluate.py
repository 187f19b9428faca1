"""`turnrl eval`: greedy rollouts of a checkpoint (or the base model) on the eval set."""

from __future__ import annotations

import dataclasses
from typing import Any

from turnrl.config import Config
from turnrl.train import checkpoint as ckpt
from turnrl.train.trainer import Trainer


async def evaluate_checkpoint(cfg: Config, checkpoint: str | None) -> dict[str, Any]:
    if cfg.data.eval is None:
        raise ValueError("turnrl eval needs data.eval (a held-out set); set data.eval.task or data.eval.path.")
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume=None))
    trainer = Trainer(cfg)
    step = 0
    try:
        if checkpoint is not None:
            path = ckpt.find_checkpoint(checkpoint, trainer.out / "checkpoints")
            ckpt.load_model_weights(trainer.policy, path)
            step = ckpt.read_state(path)["step"]
            await trainer.sync_weights(step)
        return {"step": step, **await trainer.evaluate(step)}
    finally:
        trainer.logger.close()
        await trainer.engine.close()
