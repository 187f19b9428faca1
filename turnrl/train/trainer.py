"""The RL loop: rollout -> rewards -> advantages -> policy update -> weight sync -> repeat.

Each step takes `data.prompts_per_step` tasks in a seeded order (a fresh permutation per epoch over the
data), samples `rollout.n` trajectories per task through the agent loop, scores them, and updates the
policy on exactly the tokens the engine sampled. Trajectories masked out by environment failures stay in
the batch with a zero loss mask and are left out of group baselines. Checkpoints carry the data position and
every RNG state, so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from turnrl.config import Config, dump_yaml, to_dict
from turnrl.data import Task, load_dataset
from turnrl.engines.hf import resolve_device
from turnrl.ledger import Source, Trajectory, to_batch
from turnrl.llm import close_all as close_llm_clients
from turnrl.llm import usage_metrics as llm_usage_metrics
from turnrl.models import resolve
from turnrl.observe.metrics import MetricsLogger, drop_steps_from, generation_rows
from turnrl.observe.plots import refresh_plots
from turnrl.observe.progress import Progress
from turnrl.observe.store import write_trajectories
from turnrl.rewards.collab import RolloutContext
from turnrl.rewards.functions import bind_rollout, score_all
from turnrl.rollout.factory import build_engine, build_environment, build_loop, load_template, sampling_from
from turnrl.rollout.run import reward_functions
from turnrl.rollout.scheduler import run_batch, summarize
from turnrl.train import checkpoint as ckpt
from turnrl.train.batching import Rows
from turnrl.train.optim import build_optimizer
from turnrl.train.packing import use_packed_attention
from turnrl.train.policy import (Reference, autocast_dtype, compile_layers, export_weights, is_lora, load_critic,
                                 load_policy, trainable_parameters)
from turnrl.train.update import UpdateSettings, compute_advantages, logprob_pass, policy_update


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


def settings_from(cfg: Config, device: torch.device | None = None) -> UpdateSettings:
    a, t = cfg.algo, cfg.trainer
    fused_head = t.fused_head != "off"   # also on the CPU: logits of policy tokens only (5-25x less head work here)
    if t.packing and device is not None and device.type == "cuda" and t.dtype == "float32":
        raise ValueError("trainer.packing on a GPU runs flash attention, which needs bf16: set trainer.dtype=auto "
                         "or trainer.packing=false")
    if a.kl_in_reward and a.advantage in ("grpo", "drgrpo", "rloo") and not a.turn_level:
        raise ValueError("algo.kl_in_reward needs token-level returns: use reinforce_pp(_baseline) or "
                         "algo.turn_level=true, or put the KL in the loss (kl_in_reward=false).")
    return UpdateSettings(a.advantage, a.gamma, a.lam, a.turn_level, a.clip_low, a.clip_high, a.dual_clip,
                          a.loss_agg, a.kl_coef, a.kl_type, a.kl_in_reward, a.entropy_coef, a.tis_cap,
                          a.value_clip, a.value_coef, t.epochs_per_step, t.mini_batches, t.micro_batch_tokens, t.optim.grad_clip,
                          cfg.rollout.sampling.temperature or 1.0, fused_head, t.packing,
                          t.shared_prefix and not cfg.model.gradient_checkpointing)


def accuracy_of(traj: Trajectory, part: str | None, functions: list[str]) -> float | None:
    key = part or (functions[0] if functions else "interaction")
    value = traj.reward_parts.get(key)
    return None if value is None else float(value >= 1.0)


def batch_rows(trajs: list[Trajectory], turn_level: bool, pad_id: int, device: torch.device
               ) -> tuple[Any, Rows, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch, rows, valid [N], rewards [N], groups [N]): the trajectories as training rows on `device`, with
    the engine's logprobs as the old ones until a trainer pass replaces them."""
    batch = to_batch(trajs, turn_rewards=turn_level, pad_id=pad_id)
    traj_rewards = torch.tensor([t.reward for t in trajs], device=device)
    keys: dict[str, int] = {}
    traj_groups = torch.tensor([keys.setdefault(t.group_id, len(keys)) for t in trajs], device=device)
    valid = torch.tensor([not t.masked for t in trajs], device=device)
    loss_mask = batch.loss_mask.to(device)
    rows = Rows(batch.input_ids.to(device), batch.attention_mask.to(device), batch.position_ids.to(device), loss_mask,
                batch.old_logprobs.to(device).clone(), batch.old_logprobs.to(device), torch.zeros_like(loss_mask))
    return batch, rows, valid, traj_rewards, traj_groups


def step_metrics(trajs: list[Trajectory], rows: Rows, t_rollout: float, reward_names: list[str],
                 accuracy_part: str | None) -> dict[str, Any]:
    """The step's metrics from its trajectories and training rows (rewards, turns, errors, mismatch)."""
    s = summarize(trajs, t_rollout)
    rewards = [t.reward for t in trajs if not t.masked] or [0.0]
    acc = [a for a in (accuracy_of(t, accuracy_part, reward_names) for t in trajs) if a is not None]
    m: dict[str, Any] = {
        "reward/mean": float(np.mean(rewards)), "reward/std": float(np.std(rewards)),
        "reward/min": float(np.min(rewards)), "reward/max": float(np.max(rewards)),
        "turns/mean": s["turns_mean"], "tool/calls": s["tool_calls"], "tool/errors": s["tool_errors"],
        "masked": s["masked"], "response_tokens/mean": s["response_tokens_mean"],
        "throughput/tokens_per_s": s["policy_tokens_per_s"], "trajectories": len(trajs)}
    if acc:
        m["accuracy"] = float(np.mean(acc))
    for key in s:
        if key.startswith(("termination/", "errors/", "parity/")):
            m[key] = s[key]
    for part in sorted({k for t in trajs for k in t.reward_parts}):
        have = [t.reward_parts[part] for t in trajs if part in t.reward_parts and not t.masked]
        if have:  # the mean over the trajectories that were scored on this part
            m[f"reward/{part}"] = float(np.mean(have))
    for key in sorted({k for t in trajs for k, v in t.metrics.items() if "/" in k and isinstance(v, (int, float))}):
        m[key] = float(np.mean([t.metrics[key] for t in trajs if isinstance(t.metrics.get(key), (int, float))]))
    m.update(llm_usage_metrics())  # judge / simulated-user calls and tokens since the last step
    mask = rows.loss_mask > 0
    if mask.any():
        diff = (rows.old_logprobs - rows.engine_logprobs)[mask]
        m["mismatch/mean_abs"] = float(diff.abs().mean())
        m["mismatch/max_abs"] = float(diff.abs().max())
        m["mismatch/kl"] = float((torch.exp(-diff) + diff - 1).mean())  # k3 estimate of KL(engine || trainer)
    return m


def save_samples(path: Path, trajs: list[Trajectory], batch: Any, rows: Rows, keep: int, step: int) -> None:
    """Append the first `keep` trajectories of the step, with their advantage and trainer logprobs."""
    if keep <= 0:
        return
    chosen = trajs[:keep]
    for ti, traj in enumerate(chosen):
        row = int((batch.traj_index == ti).nonzero()[-1])
        mask = rows.loss_mask[row] > 0
        traj.metrics["advantage"] = float(rows.advantages[row][mask].mean()) if mask.any() else 0.0
        traj.metrics["trainer_logprobs"] = rows.old_logprobs[row][: len(traj.segment)].tolist()
    write_trajectories(path, chosen, append=True, step=step, split="train")


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(dump_yaml(cfg))
        seed_everything(cfg.seed)
        self.device = resolve_device(cfg.trainer.device)
        self.settings = settings_from(cfg, self.device)
        self.amp = autocast_dtype(cfg.trainer.dtype, self.device)
        self.model_dir = resolve(cfg.model.name)
        d = cfg.data.train
        self.data = DataOrder(load_dataset(d.path, d.task, d.size, d.seed, d.options, d.max_rows), cfg.seed,
                              cfg.data.shuffle)
        e = cfg.data.eval
        self.eval_tasks = load_dataset(e.path, e.task, e.size, e.seed, e.options, e.max_rows) if e else []
        self.template = load_template(self.model_dir)
        self.env = build_environment(cfg.rollout)
        self.rewards = reward_functions(cfg)
        lora = cfg.model.lora
        self.policy = load_policy(str(self.model_dir), self.device, lora.rank, lora.alpha, lora.dropout,
                                  lora.target_modules, cfg.model.gradient_checkpointing)
        if self.settings.packing:   # before the reference copy, which then packs too
            use_packed_attention(self.policy)
        self.reference = Reference(self.policy) if self.settings.needs_ref else None
        if cfg.trainer.compile:
            compile_layers(self.policy)
        self.params = trainable_parameters(self.policy)
        self.critic = None
        if self.settings.advantage == "gae":  # PPO: a value model initialised from the policy's weights
            self.critic = load_critic(str(self.model_dir), self.device, lora.rank, lora.alpha, lora.target_modules)
            self.params += trainable_parameters(self.critic)
        total = cfg.trainer.steps * cfg.trainer.epochs_per_step * cfg.trainer.mini_batches
        self.optimizer, self.scheduler = build_optimizer(self.params, cfg.trainer.optim, total)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.start_step = 0
        if cfg.trainer.resume:
            self._resume(cfg.trainer.resume)
        self.engine = build_engine(cfg.engine, self.model_dir)
        bind_rollout(self.rewards, RolloutContext(self.engine, self.template, self.env, cfg.rollout, cfg.seed))
        self.logger = MetricsLogger(self.out, cfg.logging.sinks, cfg.logging.project, cfg.logging.run_name,
                                    to_dict(cfg), cfg.logging.wandb_api_key)

    def _resume(self, spec: str) -> None:
        path = ckpt.find_checkpoint(spec, self.out / "checkpoints")
        state, extra = ckpt.load_checkpoint(path, self.policy, self.optimizer, self.scheduler, self.generator)
        if self.reference is not None:
            self.reference.load_state_dict(extra.get("reference"))
        if self.critic is not None:
            self.critic.load_state_dict(extra["critic"])
        self.start_step = state["step"]
        self.data.position = state["data_position"]
        # what the killed run saved after its last checkpoint is redone: drop it so nothing appears twice
        drop_steps_from(self.out / "trajectories.jsonl", self.start_step + 1)
        print(f"[turnrl] resumed from {path} at step {self.start_step}", flush=True)

    async def sync_weights(self, version: int) -> float:
        """New weights into the engine: the adapter alone when the engine serves LoRA adapters
        (vLLM with engine.max_lora_rank >= model.lora.rank), else the changed weights (LoRA merged) in place."""
        start = time.perf_counter()
        if is_lora(self.policy) and getattr(self.engine, "lora_enabled", False):
            from peft import get_peft_model_state_dict
            config = self.policy.peft_config["default"].to_dict()
            await self.engine.update_lora(get_peft_model_state_dict(self.policy), config, version)
        else:
            await self.engine.update_weights(export_weights(self.policy), version)
        return time.perf_counter() - start

    async def run(self) -> list[dict[str, Any]]:
        history = []
        try:
            if self.start_step > 0:  # the engine starts from the base weights
                await self.sync_weights(self.start_step)
            for step in range(self.start_step, self.cfg.trainer.steps):
                metrics = await self.train_step(step)
                if self.eval_tasks and self.cfg.trainer.eval_every and (step + 1) % self.cfg.trainer.eval_every == 0:
                    metrics.update(await self.evaluate(step + 1))
                self.logger.log(step + 1, metrics)
                refresh_plots(self.out)
                history.append(metrics)
                last = step + 1 == self.cfg.trainer.steps
                every = self.cfg.trainer.save_every
                if last or (every and (step + 1) % every == 0):
                    self.save(step + 1)
        finally:
            self.logger.close()
            await self.engine.close()
            await close_llm_clients()
        return history

    def save(self, step: int) -> Path:
        extra = {}
        if self.reference is not None:
            extra["reference"] = self.reference.state_dict()
        if self.critic is not None:
            extra["critic"] = self.critic.state_dict()
        return ckpt.save_checkpoint(self.out / "checkpoints", step, self.policy, self.optimizer, self.scheduler,
                                    self.generator, {"data_position": self.data.position, "config": to_dict(self.cfg)},
                                    self.cfg.trainer.keep_checkpoints, extra or None)

    async def rollout(self, tasks: list[Task], n: int, step: int, sampling: Any = None,
                      desc: str = "rollout") -> tuple[list[Trajectory], float]:
        loop = build_loop(self.cfg.rollout, self.engine, self.template, self.env, self.cfg.seed * 1_000_003 + step,
                          sampling, policy_version=step)
        progress = Progress(len(tasks) * n, f"{desc} {step}", self.cfg.logging.progress,
                            in_flight=lambda: getattr(self.engine, "in_flight", 0))
        start = time.perf_counter()
        try:
            trajs = await run_batch(loop, tasks, n, self.cfg.rollout.concurrency,
                                    lambda t: progress.update(1, tokens=t.n_tokens(Source.POLICY)))
        finally:
            progress.close()
        return trajs, time.perf_counter() - start

    async def train_step(self, step: int) -> dict[str, Any]:
        t_step = time.perf_counter()
        tasks = self.data.take(self.cfg.data.prompts_per_step)
        trajs, t_rollout = await self.rollout(tasks, self.cfg.rollout.n, step)
        t0 = time.perf_counter()
        await score_all(trajs, self.rewards, self.cfg.reward.use_tool_rewards, self.cfg.reward.use_interaction_rewards)
        t_reward = time.perf_counter() - t0
        rows, batch, t_logprob = self._prepare(trajs)
        t0 = time.perf_counter()
        self.policy.train()
        if self.critic is not None:
            self.critic.train()
        update = policy_update(self.policy, self.optimizer, self.scheduler, rows, self.settings, self.amp,
                               self.generator, self.params, self.critic)
        t_update = time.perf_counter() - t0
        t_sync = await self.sync_weights(step + 1)
        metrics = self._metrics(trajs, rows, t_rollout)
        metrics.update(update)
        metrics.update({"lr": self.scheduler.get_last_lr()[0], "time/rollout_s": t_rollout, "time/reward_s": t_reward,
                        "time/logprob_s": t_logprob, "time/update_s": t_update, "time/sync_s": t_sync,
                        "time/step_s": time.perf_counter() - t_step})
        trained = float(rows.attention_mask.sum())
        metrics["throughput/train_tokens_per_s"] = trained / max(t_update + t_logprob, 1e-9)
        self._save_samples(trajs, batch, rows, step + 1)
        return metrics

    def _prepare(self, trajs: list[Trajectory]) -> tuple[Rows, Any, float]:
        t0 = time.perf_counter()
        dev = self.device
        batch, rows, valid, traj_rewards, traj_groups = batch_rows(
            trajs, self.settings.turn_level, self.template.tokenizer.pad_token_id or 0, dev)
        loss_mask = rows.loss_mask
        if self.reference is not None:
            with self.reference.model() as ref:
                rows.ref_logprobs = logprob_pass(ref, rows, self.settings, self.amp)
        if not self.settings.single_pass:
            self.policy.eval()
            rows.old_logprobs = logprob_pass(self.policy, rows, self.settings, self.amp)
        if self.critic is not None:
            self.critic.eval()
            rows.old_values = logprob_pass(self.critic, rows, self.settings, self.amp, values=True)
        kl = None
        if self.settings.kl_in_reward and rows.ref_logprobs is not None:
            kl = rows.engine_logprobs - rows.ref_logprobs
        batch_dev = batch._replace(traj_index=batch.traj_index.to(dev))
        rows.advantages = compute_advantages(self.settings, batch_dev, loss_mask, valid, traj_rewards, traj_groups, kl,
                                             rows)
        return rows, batch, time.perf_counter() - t0

    def _metrics(self, trajs: list[Trajectory], rows: Rows, t_rollout: float) -> dict[str, Any]:
        return step_metrics(trajs, rows, t_rollout, [f.name for f in self.rewards], self.cfg.reward.accuracy_part)

    def _save_samples(self, trajs: list[Trajectory], batch: Any, rows: Rows, step: int) -> None:
        save_samples(self.out / "trajectories.jsonl", trajs, batch, rows, self.cfg.trainer.trajectories_per_step_saved,
                     step)

    async def evaluate(self, step: int) -> dict[str, Any]:
        sampling = sampling_from(self.cfg.rollout).with_(temperature=0.0)
        trajs, seconds = await self.rollout(self.eval_tasks, 1, step, sampling, desc="eval")
        await score_all(trajs, self.rewards, self.cfg.reward.use_tool_rewards, self.cfg.reward.use_interaction_rewards)
        write_trajectories(self.out / "trajectories.jsonl", trajs[: self.cfg.trainer.trajectories_per_step_saved],
                           append=True, step=step, split="eval")
        self.logger.log_table(step, "eval/generations", generation_rows(trajs))
        names = [f.name for f in self.rewards]
        acc = [a for a in (accuracy_of(t, self.cfg.reward.accuracy_part, names) for t in trajs) if a is not None]
        out = {"eval/reward_mean": float(np.mean([t.reward for t in trajs])), "eval/seconds": seconds,
               "eval/turns_mean": float(np.mean([len(t.turns) for t in trajs]))}
        if acc:
            out["eval/accuracy"] = float(np.mean(acc))
        return out
