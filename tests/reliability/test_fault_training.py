"""Fault injection in a real training step: tiny-random through `Trainer`, with a tool that always fails.

Half of the prompts make the policy call the broken tool (the engine is wrapped so that their first turn is
that call; every other turn is the real engine's). Those trajectories must be recorded with their error and
masked out of the loss (an all-zero loss mask), the others must train (a nonzero gradient), and the step's
metrics must count the failures.
"""

import asyncio
import json
from pathlib import Path

import pytest

from turnrl.config import load_config
from turnrl.engines.base import Completion, EngineBase
from turnrl.train import step as step_module
from turnrl.train.metrics import batch_rows
from turnrl.train.trainer import Trainer

HERE = Path(__file__).parent
CALL = '<tool_call>\n{"name": "broken", "arguments": {}}\n</tool_call>'


class CallsBrokenFirst(EngineBase):
    """The real engine, except that a `[case:fail]` prompt's first turn is a call to the broken tool."""

    def __init__(self, inner, template):
        self.inner, self.template = inner, template

    async def generate(self, prompt_ids, sampling):
        text = self.template.decode(prompt_ids)
        if "[case:fail]" in text and "backend down" not in text:
            ids = self.template.encode(CALL) + [self.template.stop_token_ids[0]]
            return Completion(ids, [-0.5] * len(ids), "stop")
        return await self.inner.generate(prompt_ids, sampling)

    async def update_weights(self, named_tensors, version):
        await self.inner.update_weights(named_tensors, version)

    async def close(self):
        await self.inner.close()


@pytest.fixture()
def data(tmp_path):
    rows = [{"uid": f"{case}-{i}", "messages": [{"role": "user", "content": f"[case:{case}] What is {i} + {i}?"}],
             "ground_truth": str(2 * i)} for i, case in enumerate(["fail", "ok", "fail", "ok"])]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_failing_tool_trajectories_are_masked_and_the_rest_trains(tmp_path, data, monkeypatch):
    cfg = load_config(None, [
        "model.name=tiny-random", "engine.dtype=float32", "trainer.dtype=float32", f"data.train.path={data}",
        "data.prompts_per_step=4", "data.shuffle=false", "rollout.n=2", "rollout.max_response_tokens=80",
        "rollout.sampling.max_tokens_per_turn=30", "rollout.max_assistant_turns=2",
        f"rollout.tools=[{{class_name: '{HERE / 'broken_tools.py'}:Broken'}}]",
        f"reward.functions=[{HERE.parent / 'train' / 'rewards_for_tests.py'}:length_parity]",
        "trainer.steps=1", "trainer.optim.lr=1e-3", "logging.sinks=[]", "logging.progress=off",
        f"output_dir={tmp_path / 'run'}"])
    seen = {}

    def spy(trajs, *args):                                  # the rows run_step trains on
        out = batch_rows(trajs, *args)
        seen.update(trajs=trajs, rows=out[0])
        return out
    monkeypatch.setattr(step_module, "batch_rows", spy)
    trainer = Trainer(cfg)
    trainer.engine = CallsBrokenFirst(trainer.engine, trainer.template)
    (metrics,) = asyncio.run(trainer.run())

    trajs, rows = seen["trajs"], seen["rows"]
    failed = [i for i, t in enumerate(trajs) if t.group_id.startswith("fail")]
    assert len(failed) == 4 and len(trajs) == 8
    for i, traj in enumerate(trajs):
        traj.check()
        mask = rows.loss_mask[rows.traj_index == i]
        if i in failed:
            assert traj.masked and [(e.kind, e.blame) for e in traj.errors] == [("tool_error", "environment")]
            assert traj.errors[0].message == "tool 'broken' raised RuntimeError: backend down"
            assert mask.sum() == 0                                   # out of the loss entirely
        else:
            assert not traj.masked and traj.errors == []
            assert mask.sum() > 0
    assert metrics["masked"] == 4 and metrics["errors/tool_error"] == 4 and metrics["tool/errors"] == 4
    assert metrics["grad_norm"] > 0                                  # the healthy half trained
    saved = [json.loads(line) for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert sum(r["masked"] for r in saved) == 4
    assert {e["kind"] for r in saved for e in r["errors"]} == {"tool_error"}
