"""The RL loop on Ray: the single-process trainer's steps, with engines and training ranks as actors.

The driver (this process) keeps what is cheap and central: the data order, the agent loops (one coroutine per
trajectory, talking to the router), rewards, advantages, metrics and logs. Engine replicas
(`turnrl.distributed.replicas`) sample; training ranks (`turnrl.distributed.ranks`) hold the sharded policy and
run the update; `turnrl.distributed.sync` moves weights from ranks to replicas; `turnrl.distributed.async_rollout`
decides when each batch starts (synchronous, or pipelined under `trainer.max_staleness`).

One step: take batch b (trajectories + rewards) -> `turnrl.train.step.run_step`, the same step as the local
trainer's, with this trainer as its placement (logprob passes and the update on the ranks, planned by
`turnrl.distributed.balance`) -> weight sync -> checkpoint. A step here matches a local step on the same batch.

Not supported here (each a clear error at start): PPO's critic (`algo.advantage=gae`) and periodic evaluation
(`trainer.eval_every` with `data.eval`; run `turnrl eval` on a checkpoint instead).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from turnrl.config import Config, to_dict
from turnrl.data import Task
from turnrl.distributed import placement as place
from turnrl.distributed.async_rollout import CarryPool, Pipeline
from turnrl.distributed.balance import plan_mini, plan_passes
from turnrl.distributed.ranks import RankGroup, RankSpec, TrainRank, merge_updates, rank_param_dtype
from turnrl.distributed.replicas import EngineReplica, ReplicaPool
from turnrl.engines.router import Router
from turnrl.distributed.sync import WeightSync, resolve_transport
from turnrl.ledger import Source, Trajectory
from turnrl.observe.gc_heap import freeze_heap, gc_pauses
from turnrl.llm import close_all as close_llm_clients
from turnrl.observe.progress import Progress
from turnrl.rewards.collab import RolloutContext
from turnrl.rewards.build import reward_functions
from turnrl.rewards.functions import score_all
from turnrl.rollout.factory import build_environment, build_loop
from turnrl.rollout.loop import session_key
from turnrl.rollout.scheduler import run_batch
from turnrl.train import checkpoint as ckpt
from turnrl.train.dynamic_sampling import collect_step, shape_overlong
from turnrl.train.batching import Rows, mini_batches
from turnrl.train.step import Pass, StepInputs, rollout_seed, run_step
from turnrl.train.setup import StepRecord, open_logger, resumed, set_up_run, train_data
from turnrl.train.trainer import settings_from


@dataclass
class Rollout:
    """A finished batch: its trajectories and how its time was spent."""
    trajectories: list[Trajectory]
    version: int                   # the engine weights it started with
    data_position: int             # the data position before its tasks were taken
    seconds: float                 # first request to last trajectory
    finish_s: list[float]          # when each trajectory finished, from the batch's start
    reward_s: float
    sampling: dict[str, float] = field(default_factory=dict)   # dynamic sampling's metrics (filter_groups/*)


def straggler_metrics(finish_s: list[float]) -> dict[str, float]:
    """How long the batch waited on its slowest trajectories: the tail after half (and 90%) had finished."""
    if not finish_s:
        return {}
    t = np.sort(np.asarray(finish_s))
    last = float(t[-1])
    p50, p90 = float(np.percentile(t, 50)), float(np.percentile(t, 90))
    return {"straggler/p50_s": p50, "straggler/p90_s": p90, "straggler/last_s": last,
            "straggler/tail_frac": (last - p50) / last if last > 0 else 0.0}


def check_supported(cfg: Config) -> None:
    if cfg.algo.advantage == "gae":
        raise ValueError("algo.advantage=gae (a critic) is not supported with trainer.placement="
                         f"{cfg.trainer.placement}; use grpo/drgrpo/rloo/reinforce_pp or trainer.placement=local")
    if cfg.data.eval is not None and cfg.trainer.eval_every:
        raise ValueError(f"trainer.eval_every is not supported with trainer.placement={cfg.trainer.placement}: set "
                         "trainer.eval_every=0 and run `turnrl eval CFG --checkpoint DIR` on a saved checkpoint")
    if cfg.trainer.carry_over and cfg.algo.filter_groups.enable:
        raise ValueError("trainer.carry_over closes a batch at data.prompts_per_step finished groups; dynamic sampling "
                         "(algo.filter_groups.enable) draws groups until enough have signal: use one or the other")
    if cfg.trainer.async_rollout and cfg.algo.tis_cap is None and cfg.algo.correction.is_level is None:
        raise ValueError("trainer.async_rollout trains on samples of older policies: set algo.tis_cap (e.g. 2.0) or "
                         "algo.correction.is_level (token or sequence) so each token is importance-weighted by "
                         "trainer/engine probability")


class DistributedTrainer:
    def __init__(self, cfg: Config):
        check_supported(cfg)
        self.cfg = cfg
        t = cfg.trainer
        run = set_up_run(cfg)
        self.out, self.model_dir, self.template, self.generator = run.out, run.model_dir, run.template, run.generator
        self.data = train_data(cfg)
        self.env = build_environment(cfg.rollout)
        self.start_step = 0

        self.ray = place.start_ray(t.ray_address)
        gpus = t.gpus_per_node if t.gpus_per_node is not None else place.cluster_gpus_per_node(t.nodes)
        self.layout = place.plan_layout(t.placement, t.nodes, gpus, t.ranks, cfg.engine.replicas,
                                        cfg.engine.tensor_parallel_size, t.cpus_per_actor)
        gpu = self.layout.gpu
        # The fused head reads the lm_head weight outside FSDP's root forward (still sharded): off (as on ranks).
        self.settings = dataclasses.replace(settings_from(cfg, torch.device("cuda" if gpu else "cpu")),
                                            fused_head=False, shared_prefix=False)
        self.group = place.reserve(self.layout)
        threads = 0 if gpu else max(1, int(t.cpus_per_actor))
        engine_cfg = dataclasses.replace(cfg.engine, device="cuda" if gpu else "cpu")
        send_dtype = "float32" if cfg.engine.dtype == "float32" else (
            "bfloat16" if cfg.engine.dtype == "auto" else cfg.engine.dtype)
        lora = cfg.model.lora
        rank_param_dtype(t.param_dtype, torch.bfloat16, torch.device("cuda" if gpu else "cpu"))   # refused here, early
        spec = RankSpec(str(self.model_dir), lora.rank, lora.alpha, lora.dropout, lora.target_modules,
                        cfg.model.gradient_checkpointing, t.optim, t.steps * t.epochs_per_step * t.mini_batches,
                        self.settings, t.dtype, send_dtype, cfg.seed, gpu, threads, t.retain_host_memory,
                        param_dtype=t.param_dtype)
        rank_cls = self.ray.remote(TrainRank)
        self.ranks = RankGroup([
            rank_cls.options(**place.actor_options(self.group, self.layout.rank_bundle[r],
                                                   self.layout.rank_resources)).remote(r, self.layout.ranks, spec)
            for r in range(self.layout.ranks)])
        replica_cls = self.ray.remote(EngineReplica)

        def make_replica(slot: int, generation: int) -> Any:
            opts = place.actor_options(self.group, self.layout.replica_bundle[slot], self.layout.replica_resources)
            return replica_cls.options(**opts).remote(f"r{slot}.{generation}", str(self.model_dir), engine_cfg, threads)

        self.pool = ReplicaPool(make_replica, self.layout.replicas)
        self.router = Router(self.pool, cfg.engine.request_retries)
        transport = resolve_transport(t.weight_sync, t.placement, gpu)
        self.sync = WeightSync(transport, self.ranks, self.pool, "nccl" if gpu else "gloo")
        self.staleness = t.max_staleness if t.async_rollout else 0
        self.carry: CarryPool[Rollout] | None = None   # with trainer.carry_over, made when the run starts
        self.rewards = reward_functions(cfg, RolloutContext(self.router, self.template, self.env, cfg.rollout,
                                                            cfg.seed))
        self.step_inputs = StepInputs(self.settings, self.template.tokenizer.pad_token_id or 0, torch.device("cpu"),
                                      False, [f.name for f in self.rewards], cfg.reward.accuracy_part,
                                      self.out / "trajectories.jsonl", t.trajectories_per_step_saved)
        self.logger = open_logger(cfg, self.out)
        self.started = False
        self.positions: dict[int, int] = {}

    async def start(self) -> None:
        """Set up the ranks and start the replicas (together), then resume if asked."""
        if self.started:
            return
        import asyncio
        await asyncio.gather(self.ranks.setup(), self.pool.start())
        self.started = True
        print(f"[turnrl] ray: {self.layout.describe()}; weight sync: {self.sync.transport}", flush=True)
        if self.cfg.trainer.resume:
            await self._resume(self.cfg.trainer.resume)

    async def _resume(self, spec: str) -> None:
        path = ckpt.find_checkpoint(spec, self.out / "checkpoints")
        loaded = await self.ranks.all("load", str(path))
        state = loaded[0]["state"]
        self.generator.set_state(loaded[0]["generator"])
        self.start_step = state["step"]
        self.data.position = state["data_position"]
        await self.sync.push(self.start_step)
        resumed(self.out, path, self.start_step)

    async def run(self) -> list[dict[str, Any]]:
        steps = self.cfg.trainer.steps
        record = StepRecord(self.cfg, self.out, self.logger)
        try:
            await self.start()
            t = self.cfg.trainer
            if t.async_rollout and t.carry_over:
                self.carry = CarryPool(self.cfg.data.prompts_per_step, t.carry_over, self.start_step)
            pipe: Pipeline[Rollout] = Pipeline(self._launch, self.start_step, steps, self.staleness)
            try:
                if self.cfg.engine.gc_freeze:   # the driver runs the agent loop: its pauses stall every trajectory
                    freeze_heap()
                for step in range(self.start_step, steps):
                    t_step, gc_before = time.perf_counter(), gc_pauses().snapshot()
                    rollout, version = await pipe.take(step)
                    t_wait = time.perf_counter() - t_step
                    metrics = await self.train_on(step, rollout)
                    if self.cfg.trainer.placement == "colocated":
                        await self.pool.wake_up()
                    t0 = time.perf_counter()
                    await self.sync.push(step + 1)
                    pipe.synced(step + 1)
                    metrics.update({"time/sync_s": time.perf_counter() - t0, "time/wait_rollout_s": t_wait,
                                    "async/staleness": float(step - rollout.version),
                                    "async/in_flight": float(pipe.in_flight),
                                    "time/step_s": time.perf_counter() - t_step, **gc_pauses().since(gc_before)})
                    if record.add(step + 1, metrics):
                        await self.save(step + 1, self.positions.get(step + 1, self.data.position))
            finally:
                await pipe.close()
                if self.carry is not None:
                    await self.carry.close()
        finally:
            self.logger.close()
            await self.close()
        return record.history

    async def _launch(self, batch: int, version: int) -> Rollout:
        position = self.data.position
        self.positions[batch] = position
        if self.carry is not None:
            return await self._launch_carried(batch, version, position)
        rounds: list[Rollout] = []

        async def sample(prompts: int) -> list[Trajectory]:
            rounds.append(await self.rollout(self.data.take(prompts), self.cfg.rollout.n, batch, version, position))
            return rounds[-1].trajectories
        trajs, sampling = await collect_step(sample, self.cfg, [f.name for f in self.rewards])
        return Rollout(trajs, version, position, sum(r.seconds for r in rounds),
                       [s for r in rounds for s in r.finish_s], sum(r.reward_s for r in rounds), sampling)

    async def _launch_carried(self, batch: int, version: int, position: int) -> Rollout:
        """Batch `batch` with `trainer.carry_over`: its groups join the pool one by one, and the batch trains on
        the first `prompts_per_step` to finish (`CarryPool`); finish times count from this batch's launch."""
        assert self.carry is not None
        start = time.perf_counter()
        for task in self.data.take(self.cfg.data.prompts_per_step):
            self.carry.add(batch, version, self.rollout([task], self.cfg.rollout.n, batch, version, position,
                                                        progress="off"))
        groups = await self.carry.take(batch)
        closed = time.perf_counter()
        parts = [(g, g.task.result()) for g in groups]
        finish = [max(0.0, g.started_at + f - start) for g, r in parts for f in r.finish_s]
        return Rollout([t for _, r in parts for t in r.trajectories], min(g.version for g in groups), position,
                       closed - start, finish, sum(r.reward_s for _, r in parts),
                       {"carry/groups_in": float(sum(g.batch < batch for g in groups)),
                        "carry/groups_ahead": float(sum(g.batch > batch for g in groups)),
                        "carry/groups_out": float(self.carry.carried(batch))})

    async def rollout(self, tasks: list[Task], n: int, batch: int, version: int, position: int = 0,
                      progress: str | None = None) -> Rollout:
        """Batch `batch` of trajectories through the router, scored; each records the replica of every turn."""
        cfg = self.cfg
        seed = rollout_seed(cfg.seed, batch)
        loop = build_loop(cfg.rollout, self.router, self.template, self.env, seed, None, policy_version=version)
        bar = Progress(len(tasks) * n, f"rollout {batch}", progress or cfg.logging.progress,
                       in_flight=lambda: self.router.in_flight)
        finish: list[float] = []
        start = time.perf_counter()

        def done(traj: Trajectory) -> None:
            finish.append(time.perf_counter() - start)
            bar.update(1, tokens=traj.n_tokens(Source.POLICY))
        try:
            trajs = await run_batch(loop, tasks, n, cfg.rollout.concurrency, done)
        finally:
            bar.close()
        seconds = time.perf_counter() - start
        where = self.router.pop_sessions(session_key(seed, t.group_id, t.sample_index) for t in trajs)
        for traj in trajs:
            traj.metrics["replicas"] = where[session_key(seed, traj.group_id, traj.sample_index)]
        t0 = time.perf_counter()
        await score_all(trajs, self.rewards, cfg.reward.use_tool_rewards, cfg.reward.use_interaction_rewards)
        shape_overlong(trajs, cfg.rollout.max_response_tokens, cfg.reward.overlong.buffer, cfg.reward.overlong.penalty)
        return Rollout(trajs, version, position, seconds, finish, time.perf_counter() - t0)

    async def train_on(self, step: int, rollout: Rollout) -> dict[str, Any]:
        """The step (`turnrl.train.step.run_step`) with the ranks as its placement; its metrics (before the
        weight sync)."""
        if self.cfg.trainer.placement == "colocated":
            await self.pool.sleep()
        metrics = await run_step(self, self.step_inputs, rollout.trajectories, step, rollout.seconds)
        metrics.update(straggler_metrics(rollout.finish_s))
        metrics.update(rollout.sampling)
        metrics.update(self.router.stats.take())
        metrics.update({"time/reward_s": rollout.reward_s, "ranks": float(self.ranks.world),
                        "replicas_ready": float(sum(r.ready for r in self.pool.replicas))})
        return metrics

    # -- the Placement a step uses: the policy sharded over the training ranks --------------------------------
    async def logprobs(self, rows: Rows, which: Pass) -> torch.Tensor:
        if which == "values":
            raise ValueError("a critic does not run on Ray (check_supported refuses algo.advantage=gae)")
        passes = plan_passes(torch.arange(rows.input_ids.shape[0]), rows.lengths, self.ranks.world,
                             self.settings.micro_batch_tokens)
        return await self.ranks.logprobs(self.ray.put(rows), passes, tuple(rows.input_ids.shape),
                                         reference=which == "reference")

    async def update(self, rows: Rows) -> dict[str, float]:
        s, world = self.settings, self.ranks.world
        seq_mode = s.loss_agg != "token-mean"
        minis = [plan_mini(mini, rows.lengths, rows.loss_mask, world, s.micro_batch_tokens, seq_mode)
                 for _ in range(s.epochs)
                 for mini in mini_batches(rows.input_ids.shape[0], s.mini_batches, self.generator)]
        plans = [[(m.normalizer, m.micro[r]) for m in minis] for r in range(world)]
        results = await self.ranks.update(self.ray.put(rows), plans)
        for r in results:
            if "rows" in r:
                rows.old_logprobs[r["rows"], :r["old_logprobs"].shape[1]] = r["old_logprobs"]
        return merge_updates(results, world)

    async def save(self, step: int, data_position: int) -> Path:
        paths = await self.ranks.all("save", str(self.out / "checkpoints"), step,
                                     {"data_position": data_position, "config": to_dict(self.cfg)},
                                     self.generator.get_state(), self.cfg.trainer.keep_checkpoints)
        return Path(paths[0])

    async def close(self) -> None:
        """Stop the actors and free the placement group (Ray itself stays up for the caller)."""
        from ray.util.placement_group import remove_placement_group
        try:
            await self.router.close()
            await close_llm_clients()
            try:
                await self.ranks.all("close")
            except Exception:  # noqa: BLE001 - killing them anyway
                pass
            for actor in self.ranks.actors:
                self.ray.kill(actor, no_restart=True)
        finally:
            remove_placement_group(self.group)
