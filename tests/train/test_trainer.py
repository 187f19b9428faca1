"""The RL loop end to end on the tiny model: every estimator runs, metrics are written, resume is exact."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from turnrl.config import load_config
from turnrl.train.trainer import Trainer

HERE = Path(__file__).parent
VOLATILE = ("time/", "throughput/", "eval/seconds", "lr", "gc/")   # gc/: collections differ run to run


def tiny_config(out: Path, *extra: str):
    return load_config(None, [
        "model.name=tiny-random", "engine.dtype=float32", "trainer.dtype=float32",
        "data.train.task=calculator", "data.train.size=8", "data.prompts_per_step=2",
        "rollout.n=2", "rollout.max_response_tokens=40", "rollout.sampling.max_tokens_per_turn=12",
        f"reward.functions=[{HERE / 'rewards_for_tests.py'}:length_parity]",
        "trainer.steps=3", "trainer.optim.lr=1e-3", "logging.sinks=[]", "logging.progress=off",
        f"output_dir={out}", *extra])


def run(cfg):
    import asyncio
    return asyncio.run(Trainer(cfg).run())


def stable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}


@pytest.mark.parametrize("extra", [
    ["algo.advantage=grpo"],
    ["algo.advantage=drgrpo", "algo.loss_agg=seq-mean-token-mean"],
    ["algo.advantage=rloo", "algo.kl_coef=0.1", "algo.kl_type=k2"],
    ["algo.advantage=reinforce_pp_baseline", "algo.kl_coef=0.05", "algo.kl_in_reward=true"],
    ["algo.advantage=gae", "trainer.epochs_per_step=2", "trainer.mini_batches=2"],
    ["algo.advantage=grpo", "algo.turn_level=true", "algo.gamma=0.9", "model.lora.rank=4", "algo.kl_coef=0.1",
     "algo.entropy_coef=0.01", "algo.tis_cap=2.0", "algo.dual_clip=3.0"],
    # bf16 weights from fp32 masters: the critic's too, and a bf16 reference copy
    ["algo.advantage=gae", "algo.kl_coef=0.1", "trainer.dtype=bfloat16", "trainer.param_dtype=bfloat16"],
])
def test_estimators_train(tmp_path, extra):
    history = run(tiny_config(tmp_path, "trainer.steps=2", *extra))
    assert len(history) == 2
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    last = history[-1]
    for key in ("reward/mean", "loss/policy", "grad_norm", "entropy", "mismatch/mean_abs", "time/rollout_s",
                "time/update_s", "time/sync_s", "turns/mean", "time/gc_pause_s", "gc/full_collections"):
        assert key in last, key
    assert last["grad_norm"] > 0  # the length-parity reward varies, so the policy moves
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002"
    if "algo.kl_coef=0.1" in extra:
        assert history[-1]["kl/ref"] > 0  # the policy has moved away from the reference


@pytest.mark.parametrize("freeze", [True, False])
def test_the_heap_is_frozen_after_the_engine_and_the_first_step(tmp_path, freeze):
    """engine.gc_freeze: the startup heap and what the first step made leave the collector's full collections;
    every step reports its collection pauses."""
    import asyncio
    import gc

    from turnrl.observe.gc_heap import gc_pauses

    gc.unfreeze()
    trainer = Trainer(tiny_config(tmp_path, "trainer.steps=2", f"engine.gc_freeze={str(freeze).lower()}"))
    after_setup = gc.get_freeze_count()
    assert (after_setup > 0) == freeze
    before = gc_pauses().snapshot()
    history = asyncio.run(trainer.run())
    assert (gc.get_freeze_count() > after_setup) == freeze   # the second freeze, after step 1
    for metrics in history:
        assert metrics["time/gc_pause_s"] >= 0 and metrics["gc/full_collections"] >= 0
    counted = gc_pauses().since(before)
    assert sum(m["gc/collections"] for m in history) <= counted["gc/collections"]


def test_resume_after_kill_matches_an_uninterrupted_run(tmp_path):
    full = run(tiny_config(tmp_path / "full"))
    out = tmp_path / "killed"
    cfg_args = ["trainer.save_every=1", "logging.sinks=[]"]
    overrides = [o for o in [
        "model.name=tiny-random", "engine.dtype=float32", "trainer.dtype=float32", "data.train.task=calculator",
        "data.train.size=8", "data.prompts_per_step=2", "rollout.n=2", "rollout.max_response_tokens=40",
        "rollout.sampling.max_tokens_per_turn=12",
        f"reward.functions=[{HERE / 'rewards_for_tests.py'}:length_parity]", "trainer.steps=3",
        "trainer.optim.lr=1e-3", "logging.progress=off", f"output_dir={out}"]] + cfg_args
    (tmp_path / "empty.yaml").write_text("{}\n")
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "turnrl", "train", str(tmp_path / "empty.yaml"), *overrides],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 600
    while not latest.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert latest.exists(), "the run died before its first checkpoint:\n" + (tmp_path / "killed.log").read_text()[-2000:]
    resumed_from = int(latest.read_text().split("_")[1])
    assert resumed_from < 3, "the run finished before it could be killed"
    resumed = run(tiny_config(out, "trainer.save_every=1", "trainer.resume=latest"))
    assert len(resumed) == 3 - resumed_from
    for got, want in zip(resumed, full[resumed_from:]):
        g, w = stable(got), stable(want)
        assert g.keys() == w.keys()
        for key in w:
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), key


def test_eval_runs_greedy_on_the_held_out_set(tmp_path):
    cfg = tiny_config(tmp_path, "trainer.steps=1", "trainer.eval_every=1", "data.eval.task=calculator",
                      "data.eval.size=3", "data.eval.seed=99")
    history = run(cfg)
    assert "eval/reward_mean" in history[0]
    evals = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()
             if json.loads(x)["split"] == "eval"]
    assert len(evals) == 3


def test_unsupported_combination_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="kl_in_reward needs token-level"):
        Trainer(tiny_config(tmp_path, "algo.kl_in_reward=true", "algo.kl_coef=0.1"))


def test_the_trainer_s_thread_gives_back_its_openmp_workers_before_each_rollout(tmp_path, monkeypatch):
    """While the engine's thread computes, the trainer's pool would cost every OpenMP region of it a wake-up
    (turnrl/engines/omp_pool.py)."""
    import threading

    import turnrl.train.trainer as trainer_module

    calls: list[str] = []
    monkeypatch.setattr(trainer_module, "release_idle_pool", lambda: calls.append(threading.current_thread().name))
    history = run(tiny_config(tmp_path, "trainer.steps=2"))
    assert len(history) == 2 and calls == [threading.main_thread().name] * 2


def test_bf16_weights_with_fp32_masters_train_save_and_resume_exactly(tmp_path):
    """trainer.param_dtype=bfloat16: the checkpoint carries the fp32 masters, and a run resumed from it goes
    on as the uninterrupted one did."""
    import torch

    from turnrl.train.checkpoint import read_torch
    bf16 = ["trainer.dtype=bfloat16", "trainer.param_dtype=bfloat16", "trainer.save_every=1",
            "trainer.keep_checkpoints=3"]
    full = run(tiny_config(tmp_path / "full", *bf16))
    first = tmp_path / "full" / "checkpoints" / "step_000001"
    masters = read_torch(first, "extra.pt")["master_weights"]["masters"]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    resumed = run(tiny_config(tmp_path / "resumed", *bf16, f"trainer.resume={first}"))
    assert len(resumed) == 2 and full[-1]["grad_norm"] > 0
    for got, want in zip(resumed, full[1:]):
        g, w = stable(got), stable(want)
        assert g.keys() == w.keys()
        for key in w:
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), key
