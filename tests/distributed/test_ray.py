"""On Ray, on CPUs: two engine replicas and two gloo training ranks train the tiny model; the 2-rank update equals
the 1-rank one and the single-process one on the same batch; the router keeps trajectories on one replica
(read back from the ledger); a killed replica is replaced with nothing lost; checkpoints move between rank
counts. One local Ray instance serves the whole module."""

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from turnrl.config import load_config  # noqa: E402
from turnrl.observe.store import read_trajectories  # noqa: E402

HERE = Path(__file__).parent
REWARD = HERE.parent / "train" / "rewards_for_tests.py"


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def tiny_config(out: Path, *extra: str):
    return load_config(None, [
        "model.name=tiny-random", "engine.dtype=float32", "trainer.dtype=float32",
        "data.train.task=calculator", "data.train.size=8", "data.prompts_per_step=2",
        "rollout.n=3", "rollout.max_response_tokens=40", "rollout.sampling.max_tokens_per_turn=12",
        f"reward.functions=[{REWARD}:length_parity]", "trainer.optim.lr=1e-3", "trainer.optim.grad_clip=0",
        "logging.sinks=[]", "logging.progress=off", "trainer.trajectories_per_step_saved=100",
        "trainer.placement=split", "trainer.gpus_per_node=0", f"output_dir={out}", *extra])


@pytest.fixture(scope="module")
def trained(ray_local, tmp_path_factory):
    """Two replicas, two ranks, two steps; the trainer is kept for its engine/trainer weight comparison."""
    from turnrl.distributed.trainer import DistributedTrainer
    out = tmp_path_factory.mktemp("ray2x2")
    trainer = DistributedTrainer(tiny_config(out, "trainer.steps=2", "trainer.ranks=2", "engine.replicas=2"))

    async def run():
        await trainer.start()
        close, trainer.close = trainer.close, _noop  # keep the actors up for the checks below
        history = await trainer.run()
        engine = await trainer.pool.replicas[0].handle.fingerprint.remote()
        ranks = await asyncio.gather(*(a.fingerprint.remote() for a in trainer.ranks.actors))
        await close()
        return history, engine, ranks[0]
    history, engine, rank0 = asyncio.run(run())
    return out, history, engine, rank0


async def _noop():
    pass


def test_two_replicas_and_two_ranks_train_and_checkpoint(trained):
    out, history, _, _ = trained
    assert len(history) == 2
    for m in history:
        assert m["ranks"] == 2 and m["grad_norm"] > 0
        assert m["router/requests"] >= 6 and m["router/failed"] == 0
        assert m["async/staleness"] == 0
        assert 0 <= m["straggler/tail_frac"] <= 1 and m["time/wait_rollout_s"] > 0
        assert m["time/gc_pause_s"] >= 0 and m["gc/full_collections"] >= 0   # the driver's collection pauses
    assert (out / "checkpoints" / "latest").read_text() == "step_000002"


def test_engines_hold_what_the_trainer_sent(trained):
    _, _, engine, rank0 = trained
    assert set(rank0) <= set(engine)
    for name, value in rank0.items():
        assert engine[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name


def test_each_trajectory_ran_on_one_replica_and_both_replicas_served(trained):
    out, _, _, _ = trained
    trajs = [t for t, extra in read_trajectories(out / "trajectories.jsonl") if extra["split"] == "train"]
    assert len(trajs) == 2 * 2 * 3
    used = set()
    for traj in trajs:
        where = traj.metrics["replicas"]
        assert len(where) == len(traj.turns) >= 1          # one entry per turn
        assert len(set(where)) == 1, where                 # every turn on the same replica
        used.add(where[0])
    assert used == {"r0", "r1"}


def _rank_group(ray_local, world: int, cfg):
    from turnrl.distributed.ranks import RankGroup, RankSpec, TrainRank
    from turnrl.models import resolve
    from turnrl.train.trainer import settings_from
    t = cfg.trainer
    spec = RankSpec(str(resolve(cfg.model.name)), 0, 32.0, 0.0, "all-linear", False, t.optim, 10,
                    settings_from(cfg), "float32", "float32", cfg.seed, False, 1)
    cls = ray_local.remote(TrainRank)
    group = RankGroup([cls.options(num_cpus=1).remote(r, world, spec) for r in range(world)])
    asyncio.run(group.setup())
    return group


def _batch(cfg, out: Path):
    """The rows of the trained run's first step (real trajectories, rewards and advantages)."""
    from turnrl.rollout.factory import load_template
    from turnrl.models import resolve
    from turnrl.train.metrics import batch_rows
    from turnrl.train.trainer import settings_from
    from turnrl.train.update import compute_advantages
    trajs = [t for t, extra in read_trajectories(out / "trajectories.jsonl") if extra["step"] == 1]
    s = settings_from(cfg)
    pad = load_template(resolve(cfg.model.name)).tokenizer.pad_token_id or 0
    rows, valid, rewards, groups = batch_rows(trajs, s.turn_level, pad, torch.device("cpu"))
    rows.advantages = compute_advantages(s, rows, valid, rewards, groups)
    return rows, s


def _update(group, rows, s, budget: int):
    from turnrl.distributed.balance import plan_mini
    from turnrl.distributed.ranks import merge_updates
    mini = plan_mini(torch.arange(rows.input_ids.shape[0]), rows.lengths, rows.loss_mask, group.world, budget, False)
    plans = [[(mini.normalizer, mini.micro[r])] for r in range(group.world)]
    results = asyncio.run(group.update(ray.put(rows), plans))
    grads = ray.get(group.actors[0].full_grads.remote()) if group.world == 1 else \
        ray.get([a.full_grads.remote() for a in group.actors])[0]
    return merge_updates(results, group.world), grads


@pytest.fixture(scope="module")
def groups(ray_local, trained):
    cfg = tiny_config(trained[0])
    g1, g2 = _rank_group(ray_local, 1, cfg), _rank_group(ray_local, 2, cfg)
    yield cfg, g1, g2
    for g in (g1, g2):
        for a in g.actors:
            ray_local.kill(a)


def test_two_ranks_match_one_rank_and_the_single_process_update(groups, trained):
    from turnrl.models import resolve
    from turnrl.train.optim import build_optimizer
    from turnrl.train.policy import load_policy, trainable_parameters
    from turnrl.train.update import policy_update
    cfg, g1, g2 = groups
    rows, s = _batch(cfg, trained[0])
    assert rows.loss_mask.sum() > 0
    one, grads1 = _update(g1, rows, s, budget=64)       # small budgets: several micro-batches, and dummies
    two, grads2 = _update(g2, rows, s, budget=48)
    assert two["loss/objective"] == pytest.approx(one["loss/objective"], rel=1e-4, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    assert set(grads1) == set(grads2)
    for name in grads1:
        torch.testing.assert_close(grads2[name], grads1[name], rtol=1e-4, atol=1e-6)
    # and the single-process trainer on the same batch, from the same initial weights
    torch.manual_seed(cfg.seed)
    policy = load_policy(str(resolve(cfg.model.name)), torch.device("cpu"))
    params = trainable_parameters(policy)
    optimizer, scheduler = build_optimizer(params, cfg.trainer.optim, 10)
    local_grads = {}   # as the optimizer steps: the update frees the gradients right after its step
    optimizer.register_step_pre_hook(lambda *_: local_grads.update(
        {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}))
    local = policy_update(policy, optimizer, scheduler, dataclasses.replace(rows), s, None,
                          torch.Generator().manual_seed(0), params)
    assert local["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    assert all(p.grad is None for p in params)
    for name in grads1:
        torch.testing.assert_close(grads1[name], local_grads[name], rtol=1e-4, atol=1e-6)


def test_checkpoints_move_between_two_ranks_and_one(groups, trained, tmp_path):
    """2 ranks save -> 1 rank loads (and back): same weights, and the next update agrees (optimizer state too)."""
    cfg, g1, g2 = groups
    rows, s = _batch(cfg, trained[0])
    gen = torch.Generator().manual_seed(7).get_state()
    state = {"data_position": 4}
    path2 = ray.get([a.save.remote(str(tmp_path / "from2"), 5, state, gen, 2) for a in g2.actors])[0]
    assert ray.get([a.load.remote(path2) for a in g1.actors])[0]["state"]["step"] == 5
    fp2 = ray.get([a.fingerprint.remote() for a in g2.actors])[0]
    fp1 = ray.get(g1.actors[0].fingerprint.remote())
    assert fp1 == pytest.approx(fp2, rel=1e-6)
    after2, _ = _update(g2, rows, s, budget=4096)
    after1, _ = _update(g1, rows, s, budget=4096)
    assert after1["grad_norm"] == pytest.approx(after2["grad_norm"], rel=1e-4)
    fp2 = ray.get([a.fingerprint.remote() for a in g2.actors])[0]
    assert ray.get(g1.actors[0].fingerprint.remote()) == pytest.approx(fp2, rel=1e-5)
    # 1 -> 2, and the local trainer reads the same checkpoint format
    path1 = ray.get(g1.actors[0].save.remote(str(tmp_path / "from1"), 6, state, gen, 2))
    loaded = ray.get([a.load.remote(path1) for a in g2.actors])
    assert loaded[0]["state"]["step"] == 6
    from turnrl.models import resolve
    from turnrl.train import checkpoint as ckpt
    from turnrl.train.optim import build_optimizer
    from turnrl.train.policy import load_policy, trainable_parameters
    policy = load_policy(str(resolve(cfg.model.name)), torch.device("cpu"))
    optimizer, scheduler = build_optimizer(trainable_parameters(policy), cfg.trainer.optim, 10)
    trainer_state, _ = ckpt.load_checkpoint(Path(path1), policy, optimizer, scheduler, torch.Generator())
    assert trainer_state["step"] == 6 and len(optimizer.state) == len(trainable_parameters(policy))
    local = {n: float(t.double().sum()) for n, t in policy.state_dict().items()}
    assert {n: local[n] for n in fp2} == pytest.approx(ray.get(g1.actors[0].fingerprint.remote()), rel=1e-6)


def test_a_killed_replica_is_replaced_and_no_trajectory_is_lost(ray_local, trained, smol_template):
    from turnrl.config.schema import EngineConfig
    from turnrl.data import load_dataset
    from turnrl.distributed.replicas import EngineReplica, ReplicaPool
    from turnrl.distributed.router import Router
    from turnrl.models import resolve
    from turnrl.rollout.factory import build_environment, build_loop, load_template
    from turnrl.rollout.scheduler import run_batch
    cfg = tiny_config(trained[0])
    model_dir = resolve("tiny-random")
    cls = ray_local.remote(EngineReplica)
    engine_cfg = EngineConfig(device="cpu", dtype="float32")
    pool = ReplicaPool(lambda slot, gen: cls.options(num_cpus=1).remote(f"r{slot}.{gen}", str(model_dir),
                                                                        engine_cfg, 1), 2)
    router = Router(pool, retries=2)
    calls = {"n": 0}
    real_call = pool.call

    async def call(replica, prompt_ids, sampling):  # kill r0 as soon as it has served a few turns
        calls["n"] += 1
        if calls["n"] == 4:
            ray_local.kill(pool.replicas[0].handle)
        return await real_call(replica, prompt_ids, sampling)
    pool.call = call
    tasks = load_dataset(task="calculator", size=4, seed=0)

    async def scenario():
        await pool.start()
        loop = build_loop(cfg.rollout, router, load_template(model_dir), build_environment(cfg.rollout), seed=3)
        trajs = await run_batch(loop, tasks, 3, 64)
        await pool.wait_replacements()
        stats = router.stats.take()
        alive = await pool.replicas[0].handle.ready.remote()
        await pool.close()
        return trajs, stats, alive
    trajs, stats, alive = asyncio.run(scenario())
    assert len(trajs) == 12 and all(t.termination for t in trajs)
    assert stats["router/replica_deaths"] == 1 and pool.replaced == 1
    assert alive["name"] == "r0.1"                          # a new actor in slot 0
    for t in trajs:   # retried on r1 (finished) or recorded as an engine error: nothing silently dropped
        assert t.termination != "error" or any(e.kind == "engine" for e in t.errors)
    assert stats["router/retries"] >= 1


def test_async_lora_over_a_broadcast_group_stays_within_the_staleness_bound(ray_local, tmp_path):
    """Pipelined rollouts (max_staleness=1) with LoRA adapters sent alone over a gloo broadcast group: every batch
    records the version it was sampled with, none trains more than one version late, and the engine ends up
    with exactly the base weights plus the trained adapter."""
    from turnrl.distributed.trainer import DistributedTrainer
    from turnrl.models import resolve
    from turnrl.train import checkpoint as ckpt
    from turnrl.train.policy import export_weights, load_policy
    cfg = tiny_config(tmp_path, "trainer.steps=3", "trainer.async_rollout=true", "algo.tis_cap=2.0",
                      "trainer.weight_sync=broadcast", "model.lora.rank=4", "model.lora.alpha=8")
    trainer = DistributedTrainer(cfg)

    async def run():
        await trainer.start()
        close, trainer.close = trainer.close, _noop
        history = await trainer.run()
        engine = await trainer.pool.replicas[0].handle.fingerprint.remote()
        await close()
        return history, engine
    history, engine = asyncio.run(run())
    assert trainer.sync.transport == "broadcast"
    assert [m["async/staleness"] for m in history] == [0.0, 1.0, 1.0]     # batch 1 sampled during update 0
    assert all("correction/weight_mean" in m for m in history)
    for traj, extra in read_trajectories(tmp_path / "trajectories.jsonl"):
        trained_at = extra["step"] - 1
        assert 0 <= trained_at - traj.policy_version <= 1
    policy = load_policy(str(resolve("tiny-random")), torch.device("cpu"), lora_rank=4, lora_alpha=8.0)
    ckpt.load_model_weights(policy, tmp_path / "checkpoints" / "step_000003")
    merged = dict(export_weights(policy))
    for name, tensor in merged.items():
        assert engine[name] == pytest.approx(float(tensor.double().sum()), rel=1e-5, abs=1e-5), name


def test_colocated_placement_shares_bundles_and_trains(ray_local, tmp_path):
    from turnrl.distributed.trainer import DistributedTrainer
    trainer = DistributedTrainer(tiny_config(tmp_path, "trainer.steps=1", "trainer.placement=colocated"))
    assert trainer.layout.rank_bundle == trainer.layout.replica_bundle == [0]
    history = asyncio.run(trainer.run())
    assert len(history) == 1 and history[0]["grad_norm"] > 0 and history[0]["replicas_ready"] == 1


def test_a_two_rank_run_resumes_on_one_rank(ray_local, trained, tmp_path):
    from turnrl.distributed.trainer import DistributedTrainer
    out, first, _, _ = trained
    checkpoint = out / "checkpoints" / "step_000002"
    trainer = DistributedTrainer(tiny_config(tmp_path, "trainer.steps=3", "trainer.ranks=1", "engine.replicas=1",
                                             f"trainer.resume={checkpoint}"))
    history = asyncio.run(trainer.run())
    assert trainer.start_step == 2 and len(history) == 1 and history[0]["ranks"] == 1
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000003"
    assert [extra["step"] for _, extra in read_trajectories(tmp_path / "trajectories.jsonl")] == [3] * 6


def test_async_partial_rollouts_record_each_token_s_version(ray_local, tmp_path):
    """Async with `engine.partial_rollout`: weight syncs interrupt the requests in flight, which resume on the
    new weights. Every saved turn says which version sampled each token; no token trains more than
    max_staleness versions late (counted per token in `staleness/token_max`); interruptions are counted."""
    from turnrl.distributed.trainer import DistributedTrainer
    cfg = tiny_config(tmp_path, "trainer.steps=4", "trainer.async_rollout=true", "algo.tis_cap=2.0",
                      "engine.partial_rollout=true", "rollout.max_response_tokens=160",
                      "rollout.sampling.max_tokens_per_turn=80")
    history = asyncio.run(DistributedTrainer(cfg).run())
    assert [m["async/staleness"] for m in history] == [0.0, 1.0, 1.0, 1.0]
    assert all(0 <= m["staleness/token_max"] <= 1 and "partial/interruptions" in m for m in history)
    interrupted = 0
    for traj, extra in read_trajectories(tmp_path / "trajectories.jsonl"):
        trained_at = extra["step"] - 1
        for turn in traj.turns:
            versions = turn.token_versions(default=-1)
            assert -1 not in versions and versions == sorted(versions)
            assert all(traj.policy_version <= v <= trained_at and trained_at - v <= 1 for v in versions)
            interrupted += len(turn.versions) > 1
    assert interrupted == sum(m["partial/interrupted_turns"] for m in history)
    print(f"\n[partial] interrupted turns per step {[m['partial/interrupted_turns'] for m in history]}")


def test_partial_rollouts_without_async_are_refused(tmp_path):
    from turnrl.train.trainer import Trainer
    with pytest.raises(ValueError, match="partial_rollout.*async_rollout"):
        Trainer(load_config(None, ["engine.partial_rollout=true", f"output_dir={tmp_path}"]))


def test_carry_over_closes_batches_before_their_straggler_and_trains_every_group_once(ray_local, tmp_path):
    """`trainer.carry_over=1` with partial rollouts: the first prompt of every batch waits 2 s on its simulated
    user. Batches close at prompts_per_step finished groups, so the straggler trains one step later (carried),
    quick groups of the next batch fill the gap; every group trains exactly once, all n samples together, and no
    token is more than max_staleness + carry_over versions old."""
    import json

    from turnrl.distributed.trainer import DistributedTrainer
    rows = tmp_path / "rows.jsonl"
    with open(rows, "w") as f:
        for i in range(8):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Count to {i}."}],
                                "interaction": {"name": "slow", "delay": 2.0 if i % 2 == 0 else 0.0}}) + "\n")
    steps = 3
    cfg = tiny_config(tmp_path / "run", f"trainer.steps={steps}", "trainer.async_rollout=true", "algo.tis_cap=2.0",
                      "trainer.carry_over=1", "engine.partial_rollout=true", f"data.train.path={rows}",
                      "data.train.task=null", "data.shuffle=false", "rollout.max_user_turns=2",
                      f"rollout.interactions=[{{name: slow, class_name: '{REWARD}:SlowUser'}}]")
    history = asyncio.run(DistributedTrainer(cfg).run())
    assert [m["trajectories"] for m in history] == [6] * steps                     # 2 groups x 3 samples
    assert sum(m["carry/groups_in"] for m in history) >= 1 and sum(m["carry/groups_ahead"] for m in history) >= 1
    assert all(m["async/staleness"] <= 2 and m["staleness/token_max"] <= 2 for m in history)
    seen: dict[str, list[int]] = {}
    for traj, extra in read_trajectories(tmp_path / "run" / "trajectories.jsonl"):
        seen.setdefault(traj.group_id, []).append(extra["step"])
        assert extra["step"] - 1 - traj.policy_version <= 2
    assert len(seen) == 2 * steps and all(len(s) == 3 and len(set(s)) == 1 for s in seen.values())


def test_carry_over_needs_async_rollouts_and_no_dynamic_sampling(tmp_path):
    from turnrl.config import ConfigError
    from turnrl.distributed.trainer import check_supported
    with pytest.raises(ConfigError, match="carry_over.*async_rollout"):
        load_config(None, ["trainer.carry_over=1", "trainer.placement=split"])
    cfg = load_config(None, ["trainer.carry_over=1", "trainer.placement=split", "trainer.async_rollout=true",
                             "algo.tis_cap=2.0", "algo.filter_groups.enable=true"])
    with pytest.raises(ValueError, match="carry_over.*filter_groups"):
        check_supported(cfg)
