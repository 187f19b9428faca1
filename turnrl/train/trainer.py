"""The RL loop: rollout -> rewards -> advantages -> policy update -> weight sync -> repeat.

Each step takes `data.prompts_per_step` tasks in a seeded order (a fresh permutation per epoch over the
data), samples `rollout.n` trajectories per task through the agent loop, scores them, and updates the
policy on exactly the tokens the engine sampled. Trajectories masked out by environment failures stay in
the batch with a zero loss mask and are left out of group baselines. Checkpoints carry the data position and
every RNG state, so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from turnrl.algo.rollout_correction import CorrectionSpec
from turnrl.config import Config, to_dict
from turnrl.data import Task, load_dataset
from turnrl.engines.hf import resolve_device, resolve_dtype
from turnrl.engines.logs import route_engine_logs
from turnrl.engines.omp_pool import release_idle_pool
from turnrl.ledger import Source, Trajectory
from turnrl.llm import close_all as close_llm_clients
from turnrl.observe.gc_heap import freeze_heap, gc_pauses
from turnrl.observe.metrics import generation_rows
from turnrl.observe.progress import Progress
from turnrl.observe.store import write_trajectories
from turnrl.rewards.collab import RolloutContext
from turnrl.rewards.build import reward_functions
from turnrl.rewards.functions import score_all
from turnrl.rollout.factory import build_engine, build_environment, build_loop, sampling_from
from turnrl.rollout.scheduler import run_batch
from turnrl.train import checkpoint as ckpt
from turnrl.train.dynamic_sampling import collect_step, shape_overlong
from turnrl.train.batching import Rows
from turnrl.train.fused_projections import projections_wanted, use_fused_projections
from turnrl.train.host_memory import retain_for_training
from turnrl.train.metrics import accuracy_of
from turnrl.train.master import master_weights, resolve_param_dtype
from turnrl.train.optim import build_optimizer
from turnrl.train.packing import use_packed_attention
from turnrl.train.policy import (Reference, autocast_dtype, compile_layers, export_weights, is_lora, load_critic,
                                 load_policy, trainable_parameters)
from turnrl.train.setup import StepRecord, open_logger, resumed, set_up_run, train_data
from turnrl.train.step import Pass, StepInputs, rollout_seed, run_step
from turnrl.train.swiglu_kernel import use_fused_mlp
from turnrl.train.update import UpdateSettings, logprob_pass, policy_update


def settings_from(cfg: Config, device: torch.device | None = None) -> UpdateSettings:
    a, t = cfg.algo, cfg.trainer
    fused_head = t.fused_head != "off"   # also on the CPU: logits of policy tokens only (5-25x less head work here)
    if t.packing and device is not None and device.type == "cuda" and t.dtype == "float32":
        raise ValueError("trainer.packing on a GPU runs flash attention, which needs bf16: set trainer.dtype=auto "
                         "or trainer.packing=false")
    if a.kl_in_reward and a.advantage in ("grpo", "drgrpo", "rloo") and not a.turn_level:
        raise ValueError("algo.kl_in_reward needs token-level returns: use reinforce_pp(_baseline) or "
                         "algo.turn_level=true, or put the KL in the loss (kl_in_reward=false).")
    exact = exact_dtype(cfg, device)
    return UpdateSettings(
        advantage=a.advantage, gamma=a.gamma, lam=a.lam, turn_level=a.turn_level, clip_low=a.clip_low,
        clip_high=a.clip_high, dual_clip=a.dual_clip, loss_agg=a.loss_agg, kl_coef=a.kl_coef, kl_type=a.kl_type,
        kl_in_reward=a.kl_in_reward, entropy_coef=a.entropy_coef, tis_cap=a.tis_cap, value_clip=a.value_clip,
        value_coef=a.value_coef, epochs=t.epochs_per_step, mini_batches=t.mini_batches,
        micro_batch_tokens=t.micro_batch_tokens, grad_clip=t.optim.grad_clip,
        temperature=cfg.rollout.sampling.temperature or 1.0, fused_head=fused_head, packing=t.packing and exact is None,
        shared_prefix=t.shared_prefix and not cfg.model.gradient_checkpointing and exact is None,
        loss_mode=a.loss_mode, correction=CorrectionSpec(**dataclasses.asdict(a.correction)), exact=exact)


def use_fused_modules(model: Any, cfg: Config, device: torch.device, exact: torch.dtype | None) -> dict[str, Any]:
    """`trainer.fused_mlp` and `trainer.fused_projections` on the policy `model` (after its packed attention and
    reference copy, before torch.compile); returns what was switched: MLPs of the one, attentions and MLPs of the
    other."""
    t = cfg.trainer
    fused: dict[str, Any] = {"fused_mlps": use_fused_mlp(model) if t.fused_mlp else 0, "fused_projections": {}}
    weights = resolve_param_dtype(t.param_dtype, autocast_dtype(t.dtype, device), exact, device)
    if projections_wanted(t.fused_projections, device, weights, exact is not None, t.fused_mlp):
        fused["fused_projections"] = use_fused_projections(model, required=t.fused_projections == "on")
    return fused


def exact_dtype(cfg: Config, device: torch.device | None) -> torch.dtype | None:
    """engine.exact: the dtype the trainer's exact forward runs in (the engine's), after the checks that
    exactness needs; None when the switch is off."""
    if not cfg.engine.exact:
        return None
    if cfg.trainer.placement != "local":
        raise ValueError("engine.exact runs with trainer.placement=local (the Ray engines and ranks are not "
                         "exact yet)")
    s = cfg.rollout.sampling
    if s.top_p < 1.0 or s.top_k > 0:
        raise ValueError("engine.exact samples from the full distribution: set rollout.sampling.top_p=1 and top_k=0")
    for key in ("fused_mlp", "fused_projections"):
        if getattr(cfg.trainer, key) in (True, "on"):
            raise ValueError(f"engine.exact runs the trainer through its batch-invariant layers: set "
                             f"trainer.{key}=false")
    if cfg.algo.entropy_coef > 0:
        raise ValueError("engine.exact: the entropy bonus (algo.entropy_coef > 0) needs the logits path; set it to 0")
    if cfg.model.lora.rank > 0 and cfg.model.lora.dropout > 0:
        raise ValueError("engine.exact: LoRA dropout makes the trainer's forward differ from the engine's merged "
                         "weights; set model.lora.dropout=0")
    engine_device = resolve_device(cfg.engine.device)
    if device is not None and engine_device.type != device.type:
        raise ValueError(f"engine.exact needs the engine and the trainer on the same kind of device (engine "
                         f"{engine_device}, trainer {device}): set engine.device and trainer.device alike")
    return resolve_dtype(cfg.engine.dtype, engine_device)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        run = set_up_run(cfg)
        self.out, self.model_dir, self.template, self.generator = run.out, run.model_dir, run.template, run.generator
        self.device = resolve_device(cfg.trainer.device)
        retain_for_training(self.device.type, cfg.trainer.retain_host_memory)
        self.settings = settings_from(cfg, self.device)
        self.amp = autocast_dtype(cfg.trainer.dtype, self.device)
        self.data = train_data(cfg)
        e = cfg.data.eval
        self.eval_tasks = load_dataset(e.path, e.task, e.size, e.seed, e.options, e.max_rows) if e else []
        self.env = build_environment(cfg.rollout)
        lora = cfg.model.lora
        self.policy = load_policy(str(self.model_dir), self.device, lora.rank, lora.alpha, lora.dropout,
                                  lora.target_modules, cfg.model.gradient_checkpointing)
        if self.settings.packing:   # before the reference copy, which then packs too
            use_packed_attention(self.policy, cfg.trainer.packed_attention)
        self.reference = Reference(self.policy) if self.settings.needs_ref else None
        use_fused_modules(self.policy, cfg, self.device, self.settings.exact)   # the reference keeps its own
        if cfg.trainer.compile:
            compile_layers(self.policy, cfg.trainer.fuse_linears)
        self.critic = None
        if self.settings.advantage == "gae":  # PPO: a value model initialised from the policy's weights
            self.critic = load_critic(str(self.model_dir), self.device, lora.rank, lora.alpha, lora.target_modules)
        models = [self.policy] + ([self.critic] if self.critic is not None else [])
        frozen = [self.reference.copy] if self.reference is not None and self.reference.copy is not None else []
        self.master = master_weights(models, cfg.trainer.param_dtype, self.amp, self.settings.exact, frozen)
        self.params = self.master.masters if self.master else [p for m in models for p in trainable_parameters(m)]
        total = cfg.trainer.steps * cfg.trainer.epochs_per_step * cfg.trainer.mini_batches
        self.optimizer, self.scheduler = build_optimizer(self.params, cfg.trainer.optim, total, self.master)
        self.start_step = 0
        if cfg.trainer.resume:
            self._resume(cfg.trainer.resume)
        route_engine_logs(cfg.engine.kind, self.out, cfg.logging.engine_logs)
        self.engine = build_engine(cfg.engine, self.model_dir)
        self.rewards = reward_functions(cfg, RolloutContext(self.engine, self.template, self.env, cfg.rollout,
                                                            cfg.seed))
        self.agents = None   # your own agent through the gateway (cfg.agent) instead of the agent loop
        if cfg.agent is not None:
            try:   # the gateway's HTTP stack is an extra: only runs with `agent:` need it
                from turnrl.gateway.agents import agent_reward, build_agent_rollout
            except ImportError as exc:
                raise ImportError(f"`agent:` runs your agent through turnrl's gateway, which needs {exc.name}: "
                                  f"pip install 'turnrl[agents]'") from exc
            self.agents = build_agent_rollout(cfg, self.engine, self.template)
            if cfg.agent.returns_reward:
                self.rewards.insert(0, agent_reward(cfg.agent.reward_weight))
        self.step_inputs = StepInputs(self.settings, self.template.tokenizer.pad_token_id or 0, self.device,
                                      self.critic is not None, [f.name for f in self.rewards],
                                      cfg.reward.accuracy_part, self.out / "trajectories.jsonl",
                                      cfg.trainer.trajectories_per_step_saved)
        self.logger = open_logger(cfg, self.out)
        self._warm = False   # a step has run in this process

    def _resume(self, spec: str) -> None:
        path = ckpt.find_checkpoint(spec, self.out / "checkpoints")
        state, extra = ckpt.load_checkpoint(path, self.policy, self.optimizer, self.scheduler, self.generator)
        if self.reference is not None:
            self.reference.load_state_dict(extra.get("reference"))
        if self.critic is not None:
            self.critic.load_state_dict(extra["critic"])
        if self.master:
            self.master.resume(extra.get("master_weights"))
        self.start_step = state["step"]
        self.data.position = state["data_position"]
        resumed(self.out, path, self.start_step)

    async def sync_weights(self, version: int) -> float:
        """New weights into the engine: the adapter alone when the engine serves LoRA adapters
        (vLLM with engine.max_lora_rank >= model.lora.rank), else the changed weights (LoRA merged) in place."""
        start = time.perf_counter()
        if is_lora(self.policy) and self.engine.capabilities.lora_adapters:
            from peft import get_peft_model_state_dict
            config = self.policy.peft_config["default"].to_dict()
            await self.engine.update_lora(get_peft_model_state_dict(self.policy), config, version)
        else:
            await self.engine.update_weights(export_weights(self.policy), version)
        return time.perf_counter() - start

    async def run(self) -> list[dict[str, Any]]:
        record = StepRecord(self.cfg, self.out, self.logger)
        try:
            if self.start_step > 0:  # the engine starts from the base weights
                await self.sync_weights(self.start_step)
            for step in range(self.start_step, self.cfg.trainer.steps):
                metrics = await self.train_step(step)
                if self.eval_tasks and self.cfg.trainer.eval_every and (step + 1) % self.cfg.trainer.eval_every == 0:
                    metrics.update(await self.evaluate(step + 1))
                if record.add(step + 1, metrics):
                    self.save(step + 1)
        finally:
            self.logger.close()
            if self.agents is not None:
                await self.agents.close()
            await self.engine.close()
            await close_llm_clients()
        return record.history

    def save(self, step: int) -> Path:
        extra = {}
        if self.reference is not None:
            extra["reference"] = self.reference.state_dict()
        if self.critic is not None:
            extra["critic"] = self.critic.state_dict()
        if self.master:   # the model files hold the bf16 weights; the fp32 masters resume exactly
            extra["master_weights"] = self.master.state_dict()
        return ckpt.save_checkpoint(self.out / "checkpoints", step, self.policy, self.optimizer, self.scheduler,
                                    self.generator, {"data_position": self.data.position, "config": to_dict(self.cfg)},
                                    self.cfg.trainer.keep_checkpoints, extra or None)

    async def rollout(self, tasks: list[Task], n: int, step: int, sampling: Any = None,
                      desc: str = "rollout") -> tuple[list[Trajectory], float]:
        loop = build_loop(self.cfg.rollout, self.engine, self.template, self.env, rollout_seed(self.cfg.seed, step),
                          sampling, policy_version=step)
        release_idle_pool()   # this thread waits while the engine's computes (turnrl/engines/omp_pool.py)
        progress = Progress(len(tasks) * n, f"{desc} {step}", self.cfg.logging.progress,
                            in_flight=lambda: self.engine.in_flight)
        start = time.perf_counter()
        done = lambda t: progress.update(1, tokens=t.n_tokens(Source.POLICY))  # noqa: E731
        try:
            if self.agents is not None:
                self.agents.set_sampling(loop.sampling)
                trajs = await self.agents.run_batch(tasks, n, self.cfg.rollout.concurrency, step, done)
            else:
                trajs = await run_batch(loop, tasks, n, self.cfg.rollout.concurrency, done)
        finally:
            progress.close()
        return trajs, time.perf_counter() - start

    async def train_step(self, step: int) -> dict[str, Any]:
        gc_before = gc_pauses().snapshot()
        metrics = await self._step(step)
        metrics.update(gc_pauses().since(gc_before))
        if self.cfg.engine.gc_freeze and not self._warm:   # what the first step compiled and cached stays; the
            freeze_heap()                                   # step's own trajectories are gone by now
        self._warm = True
        return metrics

    async def _step(self, step: int) -> dict[str, Any]:
        t_step = time.perf_counter()
        spent = {"rollout": 0.0, "reward": 0.0}

        async def sample(prompts: int) -> list[Trajectory]:
            trajs, seconds = await self.rollout(self.data.take(prompts), self.cfg.rollout.n, step)
            t0 = time.perf_counter()
            await self.score(trajs)
            spent["rollout"] += seconds
            spent["reward"] += time.perf_counter() - t0
            return trajs
        trajs, sampling = await collect_step(sample, self.cfg, [f.name for f in self.rewards])
        t_rollout, t_reward = spent["rollout"], spent["reward"]
        metrics = await run_step(self, self.step_inputs, trajs, step, t_rollout)
        metrics.update(sampling)
        metrics.update({"lr": self.scheduler.get_last_lr()[0], "time/reward_s": t_reward,
                        "time/sync_s": await self.sync_weights(step + 1), "time/step_s": time.perf_counter() - t_step})
        metrics.update(self.engine.metrics())   # after the sync: a server engine's retries, revivals, sync bytes
        return metrics

    # -- the Placement a step uses (turnrl.train.step): the policy, its reference and critic in this process --
    async def logprobs(self, rows: Rows, which: Pass) -> torch.Tensor:
        if which == "reference":
            with self.reference.model() as ref:
                return logprob_pass(ref, rows, self.settings, self.amp)
        model = self.critic if which == "values" else self.policy
        model.eval()
        return logprob_pass(model, rows, self.settings, self.amp, values=which == "values")

    async def update(self, rows: Rows) -> dict[str, float]:
        self.policy.train()
        if self.critic is not None:
            self.critic.train()
        return policy_update(self.policy, self.optimizer, self.scheduler, rows, self.settings, self.amp,
                             self.generator, self.params, self.critic)

    async def score(self, trajs: list[Trajectory]) -> None:
        r = self.cfg.reward
        await score_all(trajs, self.rewards, r.use_tool_rewards, r.use_interaction_rewards)
        shape_overlong(trajs, self.cfg.rollout.max_response_tokens, r.overlong.buffer, r.overlong.penalty)

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
