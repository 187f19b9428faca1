"""GSPO, CISPO, GMPO, rollout correction and DAPO (dynamic sampling + overlong shaping) through the RL loop on
the tiny model: each trains from the config keys and logs its metrics."""

import asyncio
import json
from pathlib import Path

import pytest

from turnrl.config import ConfigError, load_config
from turnrl.train.trainer import Trainer

HERE = Path(__file__).parent


def tiny_config(out: Path, *extra: str):
    return load_config(None, [
        "model.name=tiny-random", "engine.dtype=float32", "trainer.dtype=float32",
        "data.train.task=calculator", "data.train.size=8", "data.prompts_per_step=2",
        "rollout.n=2", "rollout.max_response_tokens=40", "rollout.sampling.max_tokens_per_turn=12",
        f"reward.functions=[{HERE / 'rewards_for_tests.py'}:length_parity]",
        "trainer.steps=1", "trainer.optim.lr=1e-3", "logging.sinks=[]", "logging.progress=off",
        f"output_dir={out}", *extra])


def run(cfg):
    return asyncio.run(Trainer(cfg).run())


@pytest.mark.parametrize("extra, keys", [
    (["algo.loss_mode=gspo", "algo.loss_agg=seq-mean-token-mean", "algo.clip_low=3e-4", "algo.clip_high=4e-4",
      "trainer.mini_batches=2"], []),
    (["algo.loss_mode=cispo", "algo.clip_low=1.0", "trainer.epochs_per_step=2"], []),
    (["algo.loss_mode=gmpo", "algo.loss_agg=seq-mean-token-mean", "algo.clip_low=0.4", "algo.clip_high=0.4"], []),
    (["algo.correction.is_level=sequence", "algo.correction.is_cap=2.0", "algo.correction.rs_level=geometric",
      "algo.correction.rs_high=1.5", "algo.correction.veto=1e-4", "trainer.epochs_per_step=2"],
     ["correction/weight_mean", "correction/rejected_token_fraction", "correction/rejected_seq_fraction",
      "correction/veto_seq_fraction", "correction/truncated_fraction"]),
    (["algo.filter_groups.enable=true", "algo.filter_groups.max_rounds=3", "reward.overlong.buffer=10",
      "algo.clip_high=0.28"],
     ["filter_groups/kept", "filter_groups/dropped", "filter_groups/rounds", "filter_groups/filled",
      "reward/overlong"]),
])
def test_modes_train(tmp_path, extra, keys):
    history = run(tiny_config(tmp_path, *extra))
    assert len(history) == 1
    for key in ("loss/policy", "grad_norm", "clip_fraction", *keys):
        assert key in history[-1], key
    assert any(h["grad_norm"] > 0 for h in history)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(key in lines[-1] for key in keys)
    if "algo.filter_groups.enable=true" in extra:
        for h in history:   # a full batch, from 1..3 rounds
            assert h["trajectories"] == 4 and 1 <= h["filter_groups/rounds"] <= 3
            assert h["filter_groups/kept"] + h["filter_groups/filled"] >= 2
        assert all(h["reward/overlong"] <= 0 for h in history)


@pytest.mark.parametrize("extra, message", [
    (["algo.loss_mode=gspo"], "seq-mean-token-mean"),
    (["algo.loss_mode=cispo", "algo.dual_clip=3.0"], "dual_clip"),
    (["algo.correction.rs_level=token"], "rs_high"),
    (["algo.tis_cap=2.0", "algo.correction.is_level=token"], "tis_cap"),
    (["algo.loss_mode=sapo"], "loss_mode"),
])
def test_bad_combinations_are_clear_errors(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path, *extra)


def test_each_token_is_corrected_against_the_policy_that_sampled_it():
    """With async rollouts the weights can change between two turns of one trajectory: the engine records each
    token's logprob under the weights that sampled it, and the correction divides by exactly that."""
    import math

    import torch

    from turnrl.algo.rollout_correction import CorrectionSpec, correct
    from turnrl.ledger import Source, Trajectory
    from turnrl.train.metrics import batch_rows

    traj = Trajectory(group_id="a", sample_index=0, messages=[])
    seg = traj.segment
    seg.append([1, 2, 3], Source.PROMPT, 0)
    seg.append([4, 5], Source.POLICY, 0, [-0.1, -0.2])      # turn 0, sampled by policy version 0
    seg.append([6, 7], Source.TOOL, 0)
    seg.append([8, 9], Source.POLICY, 1, [-1.0, -2.0])      # turn 1, sampled after a weight sync (version 1)
    rows, *_ = batch_rows([traj], False, 0, torch.device("cpu"))
    policy = rows.loss_mask[0] > 0
    assert rows.engine_logprobs[0][policy].tolist() == pytest.approx([-0.1, -0.2, -1.0, -2.0])
    trainer = rows.engine_logprobs.clone()
    trainer[0, policy] = torch.tensor([-0.3, -0.2, -0.9, -2.0])   # the trainer's pi_old, one version for all
    c = correct(trainer, rows.engine_logprobs, rows.loss_mask, CorrectionSpec(is_level="token", is_cap=5.0))
    assert c.weights[0][policy].tolist() == pytest.approx([math.exp(-0.2), 1.0, math.exp(0.1), 1.0], rel=1e-5)
