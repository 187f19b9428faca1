"""Atomic checkpoints: a crash during a save never leaves a broken `latest`."""

import pytest
import torch

from turnrl.models import prepare
from turnrl.train import checkpoint as ckpt
from turnrl.train.optim import build_optimizer
from turnrl.config.schema import OptimConfig
from turnrl.train.policy import load_policy


@pytest.fixture()
def parts():
    model = load_policy(str(prepare("tiny-random")), torch.device("cpu"))
    opt, sched = build_optimizer(list(model.parameters()), OptimConfig(lr=1e-3), 10)
    return model, opt, sched, torch.Generator().manual_seed(0)


def test_roundtrip_restores_weights_optimizer_and_rng(tmp_path, parts):
    model, opt, sched, gen = parts
    loss = sum(p.sum() for p in model.parameters())
    loss.backward()
    opt.step()
    sched.step()
    path = ckpt.save_checkpoint(tmp_path, 1, model, opt, sched, gen, {"data_position": 7})
    want = {k: v.clone() for k, v in model.state_dict().items()}
    r1 = torch.rand(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    other = torch.Generator().manual_seed(123)
    torch.rand(5)
    state, _ = ckpt.load_checkpoint(ckpt.find_checkpoint("latest", tmp_path), model, opt, sched, other)
    assert state["step"] == 1 and state["data_position"] == 7
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert torch.equal(torch.rand(3), r1)  # torch RNG restored to the moment of the save
    assert other.get_state().equal(gen.get_state())
    assert path.name == "step_000001"


def test_crash_mid_save_keeps_the_previous_latest(tmp_path, parts, monkeypatch):
    model, opt, sched, gen = parts
    ckpt.save_checkpoint(tmp_path, 1, model, opt, sched, gen, {"data_position": 1})
    real_save = torch.save

    def failing_save(obj, f, *a, **k):
        if str(f).endswith("scheduler.pt"):
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(tmp_path, 2, model, opt, sched, gen, {"data_position": 2})
    assert (tmp_path / "latest").read_text() == "step_000001"
    assert not (tmp_path / "step_000002").exists()
    assert not list(tmp_path.glob(".tmp_*"))


def test_old_checkpoints_are_pruned(tmp_path, parts):
    model, opt, sched, gen = parts
    for step in range(1, 5):
        ckpt.save_checkpoint(tmp_path, step, model, opt, sched, gen, {"data_position": step}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000003", "step_000004"]


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint yet"):
        ckpt.find_checkpoint("latest", tmp_path)
