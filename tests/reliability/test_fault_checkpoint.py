"""SIGKILL during a checkpoint: the previous checkpoint stays `latest`, loads, and the run resumes exactly.

The process is killed at the two moments that matter (while the files are written; after the new directory
is in place but before `latest` names it), by a real SIGKILL from outside, with no chance to clean up.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from turnrl.config import load_config
from turnrl.config.schema import OptimConfig
from turnrl.models import prepare
from turnrl.train import checkpoint as ckpt
from turnrl.train.optim import build_optimizer
from turnrl.train.policy import load_policy
from turnrl.train.trainer import Trainer

HERE = Path(__file__).parent
# Runs `body` after patching checkpoint writing so that it stops at `stage` of the save of step 2 and waits
# there to be killed (the file `inside` says it got there).
STOPPER = textwrap.dedent("""
    import os, sys, time, torch
    from pathlib import Path
    from turnrl.train import checkpoint as ckpt
    inside, stage = Path(sys.argv[1]), sys.argv[2]
    real_save, real_pointer = torch.save, ckpt._atomic_write

    def wait_to_be_killed():
        inside.touch()
        time.sleep(600)

    def save(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        if stage == "files" and str(f).endswith("optimizer.pt") and ".tmp_step_000002" in str(f):
            wait_to_be_killed()

    def pointer(path, text):
        if stage == "pointer" and text == "step_000002":
            wait_to_be_killed()
        real_pointer(path, text)
    torch.save, ckpt._atomic_write = save, pointer
""")


def parts():
    model = load_policy(str(prepare("tiny-random")), torch.device("cpu"))
    opt, sched = build_optimizer(list(model.parameters()), OptimConfig(lr=1e-3), 10)
    return model, opt, sched, torch.Generator().manual_seed(0)


def kill_when_inside(proc, inside, log):
    deadline = time.time() + 300
    while not inside.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert inside.exists(), "the process never reached the save:\n" + log.read_text()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("stage", ["files", "pointer"])
def test_killed_while_saving_keeps_the_last_good_checkpoint(tmp_path, stage):
    root = tmp_path / "checkpoints"
    body = textwrap.dedent(f"""
        from turnrl.models import prepare
        from turnrl.train.optim import build_optimizer
        from turnrl.config.schema import OptimConfig
        from turnrl.train.policy import load_policy
        model = load_policy(str(prepare("tiny-random")), torch.device("cpu"))
        opt, sched = build_optimizer(list(model.parameters()), OptimConfig(lr=1e-3), 10)
        gen = torch.Generator().manual_seed(0)
        for step in (1, 2):
            ckpt.save_checkpoint(Path({str(root)!r}), step, model, opt, sched, gen, {{"data_position": 2 * step}})
    """)
    log = tmp_path / "log.txt"
    proc = subprocess.Popen([sys.executable, "-c", STOPPER + body, str(tmp_path / "inside"), stage],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    kill_when_inside(proc, tmp_path / "inside", log)

    assert (root / "latest").read_text() == "step_000001"
    assert (root / "step_000002").exists() == (stage == "pointer")     # complete, but not yet named latest
    model, opt, sched, gen = parts()
    state, _ = ckpt.load_checkpoint(ckpt.find_checkpoint("latest", root), model, opt, sched, gen)
    assert state["step"] == 1 and state["data_position"] == 2
    ckpt.save_checkpoint(root, 2, model, opt, sched, gen, {"data_position": 4})   # the rerun's save succeeds
    assert (root / "latest").read_text() == "step_000002"
    assert ckpt.load_checkpoint(root / "step_000002", model, opt, sched, gen)[0]["data_position"] == 4


def train_args(out):
    return ["model.name=tiny-random", "engine.dtype=float32", "trainer.dtype=float32", "data.train.task=calculator",
            "data.train.size=8", "data.prompts_per_step=2", "rollout.n=2", "rollout.max_response_tokens=24",
            "rollout.sampling.max_tokens_per_turn=12",
            f"reward.functions=[{HERE.parent / 'train' / 'rewards_for_tests.py'}:length_parity]",
            "trainer.steps=3", "trainer.save_every=1", "trainer.optim.lr=1e-3", "logging.sinks=[]",
            "logging.progress=off", f"output_dir={out}"]


def test_a_run_killed_mid_checkpoint_resumes_from_the_last_good_one(tmp_path):
    out = tmp_path / "run"
    (tmp_path / "empty.yaml").write_text("{}\n")
    body = ("from turnrl.cli import main\n"
            f"sys.exit(main(['train', {str(tmp_path / 'empty.yaml')!r}] + {train_args(out)!r}))\n")
    log = tmp_path / "log.txt"
    proc = subprocess.Popen([sys.executable, "-c", STOPPER + body, str(tmp_path / "inside"), "files"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    kill_when_inside(proc, tmp_path / "inside", log)
    assert (out / "checkpoints" / "latest").read_text() == "step_000001"
    killed = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in killed] == [1, 2]          # step 2 was trained and logged, then killed in its save

    resumed = asyncio.run(Trainer(load_config(None, train_args(out) + ["trainer.resume=latest"])).run())
    assert len(resumed) == 2                              # steps 2 and 3, from step 1's weights and data position
    for key in ("reward/mean", "loss/policy", "grad_norm", "response_tokens/mean", "masked"):
        assert resumed[0][key] == pytest.approx(killed[1][key], rel=1e-4, abs=1e-6), key   # step 2, redone exactly
    state = json.loads((out / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert state["data_position"] == 6                    # 3 steps x 2 prompts: none skipped, none taken twice
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3]                            # the killed run's step 2 is replaced, not repeated
