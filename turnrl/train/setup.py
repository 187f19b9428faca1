"""What every run does the same way, whatever trains it (the local trainer, the Ray trainer, `turnrl sft`).

`set_up_run`: the run directory (refusing an earlier run's, with the config written into it), the seeds, the
model directory, the chat template and the training data in its seeded order. `open_logger`: the metrics
sinks, opened last by the trainers so that a run that fails to build leaves no open tracking run.
`StepRecord`: after each step, log it, refresh the plots, keep it, watch for masked steps, and say when a
checkpoint is due. `resumed`: where a resumed run continues.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from turnrl.chat.templates import ChatTemplate
from turnrl.config import Config, dump_yaml, to_dict
from turnrl.data import Task, load_dataset
from turnrl.models import resolve
from turnrl.observe.metrics import MetricsLogger, drop_steps_from
from turnrl.observe.plots import refresh_plots
from turnrl.rollout.factory import load_template
from turnrl.train.health import MaskedSteps
from turnrl.train.rundir import prepare_run_dir


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class DataOrder:
    """Tasks in a seeded order: epoch e visits a permutation drawn from Random(seed + e)."""

    def __init__(self, tasks: list[Task], seed: int, shuffle: bool, position: int = 0):
        if not tasks:
            raise ValueError("the training data set is empty")
        self.tasks, self.seed, self.shuffle, self.position = tasks, seed, shuffle, position

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def take(self, k: int) -> list[Task]:
        out = []
        for _ in range(k):
            epoch, offset = divmod(self.position, len(self.tasks))
            out.append(self.tasks[self._order(epoch)[offset]])
            self.position += 1
        return out


def train_data(cfg: Config) -> DataOrder:
    d = cfg.data.train
    return DataOrder(load_dataset(d.path, d.task, d.size, d.seed, d.options, d.max_rows), cfg.seed, cfg.data.shuffle)


@dataclass
class RunSetup:
    out: Path
    model_dir: Path
    template: ChatTemplate
    generator: torch.Generator    # the run's own random stream (micro-batch order), checkpointed


def set_up_run(cfg: Config) -> RunSetup:
    if cfg.engine.partial_rollout and not cfg.trainer.async_rollout:
        raise ValueError("engine.partial_rollout interrupts the requests in flight when new weights arrive, which "
                         "only happens while they run with trainer.async_rollout=true (and placement split): set "
                         "it, or drop engine.partial_rollout")
    out = prepare_run_dir(cfg)   # refuses to write into an earlier run
    (out / "config.yaml").write_text(dump_yaml(cfg))
    seed_everything(cfg.seed)
    model_dir = resolve(cfg.model.name)
    template = load_template(model_dir, cfg.model.chat_template, cfg.model.chat_template_kwargs)
    return RunSetup(out, model_dir, template, torch.Generator().manual_seed(cfg.seed))


def open_logger(cfg: Config, out: Path) -> MetricsLogger:
    return MetricsLogger(out, cfg.logging.sinks, cfg.logging.project, cfg.logging.run_name, to_dict(cfg),
                         cfg.logging.wandb_api_key)


def resumed(out: Path, path: Path, step: int) -> None:
    """A run resumed from checkpoint `path` at `step`: what the killed run saved after it is redone, so it is
    dropped here and nothing appears twice."""
    drop_steps_from(out / "trajectories.jsonl", step + 1)
    print(f"[turnrl] resumed from {path} at step {step}", flush=True)


@dataclass
class StepRecord:
    """The bookkeeping after each RL step, the same for every placement."""
    cfg: Config
    out: Path
    logger: MetricsLogger
    history: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.masked = MaskedSteps(self.cfg.trainer.max_masked_steps)

    def add(self, step: int, metrics: dict[str, Any]) -> bool:
        """Record step `step` (1-based); True when a checkpoint is due (every `save_every` steps, and the last)."""
        self.logger.log(step, metrics)
        refresh_plots(self.out)
        self.history.append(metrics)
        self.masked.observe(step, metrics)   # raises after too many steps with nothing to train on
        every = self.cfg.trainer.save_every
        return step == self.cfg.trainer.steps or bool(every and step % every == 0)
