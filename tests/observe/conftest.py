"""Observe fixtures: one training-style run directory, built once from real rollouts.

Steps 1 and 2 are real `turnrl rollout` runs of the tiny random model (real engine, chat template and
ledgers; garbage text): step 1 on the calculator task (all end at the token budget), step 2 on
feedback_math (a rule-based user answers every turn; they end when its attempts run out). Step 3 runs the
real agent loop, calculator tool and chat template with a stand-in policy that writes fixed texts, because
a random model never calls a tool: a correct call and answer (eos), an unknown tool (a tool_parse error),
and two calls in a row (max_assistant_turns). The trainer's extra fields are added as `Trainer._save_samples`
writes them: a GRPO advantage per trajectory and trainer logprobs aligned with the last segment (the engine's
plus a small known offset, so the mismatch is non-zero). metrics.jsonl is synthetic.
"""

import asyncio
import json
import re
import shutil
from pathlib import Path

import pytest

from turnrl.config import config_from_dict
from turnrl.data import load_dataset
from turnrl.engines.base import Completion, EngineBase
from turnrl.ledger import Source
from turnrl.models import resolve
from turnrl.observe.store import read_trajectories, write_trajectories
from turnrl.rewards.functions import score_all
from turnrl.rollout.factory import build_environment, build_loop, load_template
from turnrl.collect import rollout_to_dir
from turnrl.rewards.build import reward_functions
from turnrl.rollout.scheduler import run_batch

TINY = {"model": {"name": "tiny-random"}, "logging": {"progress": "off"}, "seed": 0}
CALCULATOR = {**TINY, "data": {"train": {"task": "calculator", "size": 2, "seed": 0, "options": {"demo": True}}},
              "rollout": {"n": 2, "max_assistant_turns": 2, "max_response_tokens": 40,
                          "sampling": {"max_tokens_per_turn": 24}},
              "reward": {"functions": ["exact_answer", "tool_success"]}}
FEEDBACK = {**TINY, "data": {"train": {"task": "feedback_math", "size": 2, "seed": 1}},
            "rollout": {"n": 2, "max_assistant_turns": 4, "max_response_tokens": 200,
                        "sampling": {"max_tokens_per_turn": 8}},
            "reward": {"functions": []}}
SCRIPTED = {**CALCULATOR, "data": {"train": {"task": "calculator", "size": 1, "seed": 5, "options": {"demo": True}}},
            "rollout": {"n": 3, "max_assistant_turns": 2, "max_response_tokens": 200, "concurrency": 1,
                        "sampling": {"max_tokens_per_turn": 64}}}
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n</tool_call>'
BAD_CALL = '<tool_call>\n{{"name": "abacus", "arguments": {{"beads": 3}}}}\n</tool_call>'
ANSWER = "The calculator says {result}.\n#### {result}"
# one text per turn; with concurrency 1 the samples run one after the other
SCRIPT = [CALL, ANSWER, BAD_CALL, "I cannot tell.", CALL, CALL]
TRAINER_OFFSET = 0.0625   # trainer logprob = engine logprob - this, on policy tokens


class StandInPolicy(EngineBase):
    """Writes the scripted texts in order, filling in the task's expression and the last tool result."""

    def __init__(self, template, texts):
        self.template, self.texts = template, list(texts)

    async def generate(self, prompt_ids, sampling):
        prompt = self.template.decode(prompt_ids)
        expr = re.findall(r"What is ([^?]+)\?", prompt)[-1]
        results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", prompt, re.S)   # SmolLM2's tool turns
        text = self.texts.pop(0).format(expr=expr, result=results[-1] if results else "?")
        ids = self.template.encode(text) + [self.template.stop_token_ids[0]]
        return Completion(ids, [-0.5] * len(ids), "stop")


def add_trainer_fields(trajectories):
    """What the trainer saves: GRPO advantages per group, trainer logprobs of the last segment."""
    groups = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t.reward)
    for t in trajectories:
        rewards = groups[t.group_id]
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        t.metrics["advantage"] = (t.reward - mean) / (std + 1e-6)
        seg = t.segment
        t.metrics["trainer_logprobs"] = [lp - TRAINER_OFFSET if s == Source.POLICY else -3.0
                                         for lp, s in zip(seg.logprobs, seg.sources)]
    return trajectories


async def scripted_rollout(cfg):
    d = cfg.data.train
    tasks = load_dataset(d.path, d.task, d.size, d.seed, d.options, d.max_rows)
    template = load_template(resolve(cfg.model.name))
    loop = build_loop(cfg.rollout, StandInPolicy(template, SCRIPT), template, build_environment(cfg.rollout), cfg.seed)
    trajectories = await run_batch(loop, tasks, cfg.rollout.n, cfg.rollout.concurrency)
    await score_all(trajectories, reward_functions(cfg), cfg.reward.use_tool_rewards,
                    cfg.reward.use_interaction_rewards)
    return trajectories


def synthetic_metrics(steps):
    lines = []
    for step in range(1, steps + 1):
        m = {"step": step, "reward/mean": 0.1 * step, "accuracy": 0.05 * step, "turns/mean": 1.5 + step / 10,
             "response_tokens/mean": 40.0 + step, "kl/ref": 0.001 * step, "entropy": 1.2 - 0.1 * step,
             "mismatch/mean_abs": TRAINER_OFFSET, "tool/calls": 3 * step, "tool/errors": step,
             "throughput/tokens_per_s": 100.0 + step, "time/rollout_s": 2.0, "time/update_s": 3.0,
             "time/sync_s": 0.1, "time/logprob_s": 0.5, "time/reward_s": 0.01, "loss/policy": -0.01 * step}
        if step == 2:
            m.update({"eval/reward_mean": 0.3, "eval/accuracy": 0.25})
        lines.append(json.dumps(m))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("observe")
    run = root / "run"
    run.mkdir()
    path = run / "trajectories.jsonl"
    for step, spec in ((1, CALCULATOR), (2, FEEDBACK)):
        out = root / f"rollout{step}"
        asyncio.run(rollout_to_dir(config_from_dict(spec), out))
        trajectories = [t for t, _ in read_trajectories(out / "trajectories.jsonl")]
        write_trajectories(path, add_trainer_fields(trajectories), append=True, step=step, split="train")
        if step == 2:   # an evaluation at step 2: no trainer fields
            write_trajectories(path, [t for t, _ in read_trajectories(out / "trajectories.jsonl")][:2], append=True,
                               step=step, split="eval")
    shutil.copy(root / "rollout1" / "config.yaml", run / "config.yaml")
    scripted = asyncio.run(scripted_rollout(config_from_dict(SCRIPTED)))
    write_trajectories(path, add_trainer_fields(scripted), append=True, step=3, split="train")
    (run / "metrics.jsonl").write_text(synthetic_metrics(3))
    return run


@pytest.fixture(scope="session")
def ledger(run_dir):
    """[(trajectory, extra fields)] for every line of the run's trajectories.jsonl."""
    return list(read_trajectories(run_dir / "trajectories.jsonl"))
