"""Running `turnrl sft`: plain SFT epochs, or rejection-sampling rounds (collect -> filter -> SFT)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from turnrl.config import Config, ConfigError
from turnrl.engines.hf import resolve_device
from turnrl.ledger import Trajectory
from turnrl.observe.plots import refresh_plots
from turnrl.rewards.functions import score_all
from turnrl.rollout.factory import build_engine, build_environment, build_loop
from turnrl.rewards.build import reward_functions
from turnrl.rollout.scheduler import run_batch
from turnrl.train import checkpoint as ckpt
from turnrl.train.host_memory import retain_for_training
from turnrl.train.master import master_weights
from turnrl.train.optim import build_optimizer
from turnrl.train.policy import autocast_dtype, export_weights, load_policy, trainable_parameters
from turnrl.train.sft import load_examples, sft_epoch
from turnrl.train.setup import open_logger, set_up_run, train_data


class SFTRun:
    def __init__(self, cfg: Config):
        if cfg.sft.rounds > 0 and cfg.trainer.resume:
            # Rounds keep no resumable state: ignoring the option would restart from the base model and
            # overwrite this run's checkpoints.
            raise ConfigError("trainer.resume is not supported with rejection sampling (sft.rounds > 0). Unset "
                              "trainer.resume; plain SFT (sft.rounds=0) resumes.")
        self.cfg = cfg
        run = set_up_run(cfg)   # each fit draws its own generator (`_optimizer`)
        self.out, self.model_dir, self.template = run.out, run.model_dir, run.template
        self.device = resolve_device(cfg.trainer.device)
        retain_for_training(self.device.type, cfg.trainer.retain_host_memory)
        self.amp = autocast_dtype(cfg.trainer.dtype, self.device)
        self.pad_id = self.template.tokenizer.pad_token_id or 0
        lora = cfg.model.lora
        self.policy = load_policy(str(self.model_dir), self.device, lora.rank, lora.alpha, lora.dropout,
                                  lora.target_modules, cfg.model.gradient_checkpointing)
        self.master = master_weights([self.policy], cfg.trainer.param_dtype, self.amp)   # as the RL trainer
        self.params = self.master.masters if self.master else trainable_parameters(self.policy)
        self.logger = open_logger(cfg, self.out)
        self.step = 0
        self.history: list[dict[str, Any]] = []

    def _fit(self, examples: list[Trajectory]) -> list[Trajectory]:
        keep = [t for t in examples if len(t.segment) <= self.cfg.sft.max_length]
        if len(keep) < len(examples):
            print(f"[turnrl] sft: skipped {len(examples) - len(keep)} conversations longer than "
                  f"sft.max_length={self.cfg.sft.max_length}", flush=True)
        if not keep:
            raise ValueError("no SFT examples: check data.train (conversations need assistant turns) and "
                             "sft.max_length")
        return keep

    def _optimizer(self, n_examples: int, passes: int) -> None:
        per_epoch = math.ceil(n_examples / self.cfg.sft.batch_size)
        self.per_epoch = per_epoch
        self.optimizer, self.scheduler = build_optimizer(self.params, self.cfg.trainer.optim, per_epoch * passes,
                                                         self.master)
        self.generator = torch.Generator().manual_seed(self.cfg.seed)

    def _on_step(self, metrics: dict[str, Any]) -> None:
        self.step += 1
        self.logger.log(self.step, metrics)
        self.history.append(metrics)
        every = self.cfg.trainer.save_every
        if every and self.step % every == 0:
            self.save({})

    def save(self, state: dict[str, Any]) -> Path:
        return ckpt.save_checkpoint(self.out / "checkpoints", self.step, self.policy, self.optimizer, self.scheduler,
                                    self.generator, {"data_position": self.step, **state},
                                    self.cfg.trainer.keep_checkpoints,
                                    {"master_weights": self.master.state_dict()} if self.master else None)

    def _epochs(self, examples: list[Trajectory], epochs: int, first_epoch: int = 0, skip: int = 0) -> None:
        t = self.cfg.trainer
        for epoch in range(first_epoch, epochs):
            sft_epoch(self.policy, self.optimizer, self.scheduler, examples, self.cfg.sft.batch_size,
                      t.micro_batch_tokens, t.optim.grad_clip, self.amp, self.device, self.cfg.seed + epoch,
                      self.pad_id, skip if epoch == first_epoch else 0, lambda b, m: self._on_step(m), self.params)

    async def run(self) -> list[dict[str, Any]]:
        try:
            if self.cfg.sft.rounds > 0:
                await self._rejection_sampling()
            else:
                examples = self._fit(load_examples(self.cfg, self.template)[0])
                self._optimizer(len(examples), self.cfg.sft.epochs)
                first_epoch, skip = 0, 0
                if self.cfg.trainer.resume:
                    path = ckpt.find_checkpoint(self.cfg.trainer.resume, self.out / "checkpoints")
                    state, extra = ckpt.load_checkpoint(path, self.policy, self.optimizer, self.scheduler,
                                                        self.generator)
                    if self.master:
                        self.master.resume(extra.get("master_weights"))
                    self.step = state["step"]
                    first_epoch, skip = divmod(self.step, self.per_epoch)
                self._epochs(examples, self.cfg.sft.epochs, first_epoch, skip)
            self.save({})
            self.export()
        finally:
            self.logger.close()
        refresh_plots(self.out)
        return self.history

    async def _rejection_sampling(self) -> None:
        """Each round: sample with the current weights, keep trajectories with reward >= min_reward,
        fine-tune on their exact tokens."""
        s = self.cfg.sft
        tasks = train_data(self.cfg)
        env, rewards = build_environment(self.cfg.rollout), reward_functions(self.cfg)
        engine = build_engine(self.cfg.engine, self.model_dir)
        self._optimizer(s.prompts_per_round * self.cfg.rollout.n, s.rounds * s.epochs)
        try:
            for r in range(s.rounds):
                await engine.update_weights(export_weights(self.policy), r)
                loop = build_loop(self.cfg.rollout, engine, self.template, env, self.cfg.seed * 7919 + r)
                trajs = await run_batch(loop, tasks.take(s.prompts_per_round), self.cfg.rollout.n,
                                        self.cfg.rollout.concurrency)
                await score_all(trajs, rewards, self.cfg.reward.use_tool_rewards,
                                self.cfg.reward.use_interaction_rewards)
                accepted = [t for t in trajs if t.reward >= s.min_reward and not t.masked]
                self.logger.log(self.step, {"rft/round": r, "rft/accepted": len(accepted), "rft/sampled": len(trajs),
                                            "reward/mean": sum(t.reward for t in trajs) / len(trajs)})
                if accepted:
                    self._epochs(self._fit(accepted), s.epochs)
        finally:
            await engine.close()

    def export(self) -> Path:
        """The final model as a plain Hugging Face directory (LoRA merged), bf16, with its tokenizer."""
        target = Path(self.cfg.sft.export_dir or self.out / "model")
        model = self.policy
        if hasattr(model, "merge_and_unload"):
            model = model.merge_and_unload()
        model = model.to(torch.bfloat16)
        model.config.use_cache = True
        model.save_pretrained(target, safe_serialization=True)
        self.template.tokenizer.save_pretrained(target)
        print(f"[turnrl] sft model written to {target}", flush=True)
        return target
