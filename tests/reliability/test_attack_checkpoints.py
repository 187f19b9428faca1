"""Broken checkpoint files: truncated, zeroed, one flipped byte, from a real 2-step run of the tiny model.

Every load checks the sizes and sha256 sums that the save wrote into `manifest.json`; a mismatch, an
unreadable file or a load error is a `CheckpointError` (a `ConfigError`: `turnrl` prints it, exits 2, no
traceback) that names the file, says what is wrong and names the previous checkpoint to resume from.
"""

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from turnrl.config import ConfigError
from turnrl.config.schema import OptimConfig
from turnrl.models import prepare
from turnrl.train import checkpoint as ckpt
from turnrl.train.optim import build_optimizer
from turnrl.train.policy import load_policy
from turnrl.train.trainer import Trainer

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "train"))
from test_trainer import tiny_config  # noqa: E402  (the tiny training run of tests/train)


def run(cfg):
    return asyncio.run(Trainer(cfg).run())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 2 steps with a checkpoint after each: checkpoints/step_000001 and step_000002 (latest)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    run(tiny_config(out, "trainer.steps=2", "trainer.save_every=1"))
    assert (out / "checkpoints" / "latest").read_text() == "step_000002"
    return out


@pytest.fixture
def copy(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def zero(f: Path) -> None:
    f.write_bytes(bytes(f.stat().st_size))


def flip(f: Path) -> None:
    """One bit of one byte in the back half (tensor data, not the header): the file still parses."""
    data = bytearray(f.read_bytes())
    data[len(data) * 3 // 4] ^= 0x01
    f.write_bytes(bytes(data))


def resume_error(out: Path) -> str:
    with pytest.raises(ConfigError) as info:
        run(tiny_config(out, "trainer.steps=3", "trainer.save_every=1", "trainer.resume=latest"))
    assert isinstance(info.value, ckpt.CheckpointError)
    return str(info.value)


def assert_names_file_and_previous(message: str, out: Path, name: str, what: str) -> None:
    broken = out / "checkpoints" / "step_000002" / name
    assert str(broken) in message, message
    assert what in message, message
    assert f"trainer.resume={out / 'checkpoints' / 'step_000001'}" in message, message


@pytest.mark.parametrize("name, damage, what", [
    ("model/model.safetensors", truncate, "size"),
    ("optimizer.pt", truncate, "size"),
    ("model/model.safetensors", zero, "all zero bytes"),
    ("optimizer.pt", zero, "all zero bytes"),
    ("model/model.safetensors", flip, "checksum"),
    ("optimizer.pt", flip, "checksum"),
    ("trainer_state.json", flip, "checksum"),
])
def test_a_damaged_file_names_itself_and_the_previous_step(copy, name, damage, what):
    damage(copy / "checkpoints" / "step_000002" / name)
    assert_names_file_and_previous(resume_error(copy), copy, name, what)


def test_a_missing_file_is_named(copy):
    (copy / "checkpoints" / "step_000002" / "rng.pt").unlink()
    assert_names_file_and_previous(resume_error(copy), copy, "rng.pt", "missing")


def test_a_good_checkpoint_still_resumes_and_its_save_has_a_manifest(copy):
    step = copy / "checkpoints" / "step_000002"
    manifest = ckpt.read_manifest(step)
    assert {"model/model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "trainer_state.json"} <= set(manifest)
    for rel, entry in manifest.items():
        assert entry["size"] == (step / rel).stat().st_size and len(entry["sha256"]) == 64
    history = run(tiny_config(copy, "trainer.steps=3", "trainer.save_every=1", "trainer.resume=latest"))
    assert len(history) == 1
    assert ckpt.read_manifest(copy / "checkpoints" / "step_000003")


def test_an_old_checkpoint_without_a_manifest_still_loads_and_load_errors_are_clear(copy, capsys):
    for step in ("step_000001", "step_000002"):
        (copy / "checkpoints" / step / ckpt.MANIFEST).unlink()
    # without a manifest nothing can catch a flipped byte, but a file that does not load is still named
    old = copy / "checkpoints" / "step_000002"
    good = (old / "optimizer.pt").read_bytes()
    truncate(old / "optimizer.pt")
    model, opt, sched, gen = parts()
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_checkpoint(old, model, opt, sched, gen)
    message = str(info.value)
    assert str(old / "optimizer.pt") in message and "cannot be read" in message, message
    assert f"trainer.resume={copy / 'checkpoints' / 'step_000001'}" in message, message
    assert "has no manifest.json" in capsys.readouterr().out   # a one-line note, once per checkpoint
    (old / "optimizer.pt").write_bytes(good)
    history = run(tiny_config(copy, "trainer.steps=3", "trainer.save_every=1", "trainer.resume=latest"))
    assert len(history) == 1


def parts(lora_rank: int = 0):
    model = load_policy(str(prepare("tiny-random")), torch.device("cpu"), lora_rank)
    opt, sched = build_optimizer([p for p in model.parameters() if p.requires_grad], OptimConfig(lr=1e-3), 10)
    return model, opt, sched, torch.Generator().manual_seed(0)


def test_a_flipped_byte_in_a_lora_adapter_is_caught_by_eval_and_serve_loads_too(tmp_path):
    root = tmp_path / "checkpoints"
    model, opt, sched, gen = parts(lora_rank=4)
    for step in (1, 2):
        ckpt.save_checkpoint(root, step, model, opt, sched, gen, {"data_position": 2 * step})
    adapter = root / "step_000002" / "model" / "adapter_model.safetensors"
    flip(adapter)
    with pytest.raises(ckpt.CheckpointError) as info:   # the path of `turnrl eval --checkpoint` / `turnrl serve`
        ckpt.load_model_weights(model, root / "step_000002")
    message = str(info.value)
    assert str(adapter) in message and "checksum" in message, message
    assert f"trainer.resume={root / 'step_000001'}" in message, message
    ckpt.load_model_weights(model, root / "step_000001")   # the previous one is fine
    with pytest.raises(ckpt.CheckpointError, match="No earlier checkpoint"):
        zero(root / "step_000001" / "model" / "adapter_model.safetensors")
        shutil.rmtree(root / "step_000002")
        ckpt.load_model_weights(model, root / "step_000001")


def test_the_cli_prints_the_error_without_a_traceback(copy, tmp_path):
    zero(copy / "checkpoints" / "step_000002" / "optimizer.pt")
    (tmp_path / "empty.yaml").write_text("{}\n")
    args = ["model.name=tiny-random", "engine.dtype=float32", "trainer.dtype=float32",
            "data.train.task=calculator", "data.train.size=8", "data.prompts_per_step=2", "rollout.n=2",
            "rollout.max_response_tokens=40", "rollout.sampling.max_tokens_per_turn=12",
            f"reward.functions=[{HERE.parent / 'train' / 'rewards_for_tests.py'}:length_parity]",
            "trainer.steps=3", "trainer.save_every=1", "trainer.optim.lr=1e-3", "logging.sinks=[]",
            "logging.progress=off", f"output_dir={copy}", "trainer.resume=latest"]
    proc = subprocess.run([sys.executable, "-m", "turnrl", "train", str(tmp_path / "empty.yaml"), *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert str(copy / "checkpoints" / "step_000002" / "optimizer.pt") in proc.stderr
    assert "step_000001" in proc.stderr
