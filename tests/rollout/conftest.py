"""Rollout fixtures: a scripted engine, one real HF engine for the session, and the real-model rollouts.

The scripted engine answers like a policy would, from a script: each task's prompt carries a tag such as
`[case:bad_json]` and the engine returns that tag's texts turn by turn, tokenized with the real SmolLM2
tokenizer plus `<|im_end|>`, cut to `max_tokens` with finish 'length' like a real engine. A script entry that
is an exception is raised instead. Every request is recorded (tag, prompt length, sampling).
"""

import asyncio
import re
from collections import defaultdict

import pytest

from turnrl.chat.parsers import HermesParser
from turnrl.config.schema import EngineConfig
from turnrl.engines.base import Completion, EngineBase, Sampling
from turnrl.rollout.loop import AgentLoop, Environment, Limits

TAG = re.compile(r"\[case:(\w+)\]")


class ScriptedEngine(EngineBase):
    def __init__(self, template, scripts, logprob=-0.25):
        self.template = template
        self.scripts = scripts
        self.logprob = logprob
        self.turns = defaultdict(int)
        self.requests = []              # (tag, len(prompt_ids), sampling)

    async def generate(self, prompt_ids, sampling):
        await asyncio.sleep(0)
        tags = TAG.findall(self.template.decode(prompt_ids))
        assert tags, "scripted prompts carry a [case:NAME] tag"
        tag = tags[-1]
        self.requests.append((tag, len(prompt_ids), sampling))
        turn = self.turns[tag]
        self.turns[tag] += 1
        script = self.scripts[tag]
        entry = script[min(turn, len(script) - 1)]
        if isinstance(entry, BaseException):
            raise entry
        ids = self.template.encode(entry) + [self.template.stop_token_ids[0]]
        finish = "stop"
        if len(ids) > sampling.max_tokens:
            ids, finish = ids[:sampling.max_tokens], "length"
        return Completion(ids, [self.logprob] * len(ids), finish)

    async def close(self):
        return None


@pytest.fixture(scope="session")
def scripted(smol_template):
    """scripted(scripts, template=None) -> a ScriptedEngine on the real SmolLM2 tokenizer (or `template`)."""
    return lambda scripts, template=None, **kw: ScriptedEngine(template or smol_template, scripts, **kw)


@pytest.fixture(scope="session")
def make_loop(smol_template):
    """make_loop(engine, env, limits=..., sampling=...) -> an AgentLoop with the hermes parser."""
    def make(engine, env=None, limits=None, sampling=None, seed=0):
        return AgentLoop(engine, smol_template, HermesParser(), env or Environment(), limits or Limits(),
                         sampling or Sampling(max_tokens=64), seed=seed)
    return make


@pytest.fixture(scope="session")
def smol_engine(smollm2_dir, torch_threads):
    """The real HF engine on SmolLM2 with the default engine config, shared by the rollout tests; its worker
    runs torch on one thread (see `torch_threads`), pinned by a one-token warm-up."""
    from turnrl.rollout.factory import build_engine
    with torch_threads(1):
        engine = build_engine(EngineConfig(), smollm2_dir)
        asyncio.run(engine.generate([1, 2, 3], Sampling(max_tokens=1)))
    yield engine
    asyncio.run(engine.close())


# -- real-model rollouts ------------------------------------------------------------------------------------
class RecordingEngine(EngineBase):
    """Passes requests to a real engine and records {(prompt, seed): (sampling, completion)}."""

    def __init__(self, inner):
        self.inner = inner
        self.records = {}

    async def generate(self, prompt_ids, sampling):
        completion = await self.inner.generate(prompt_ids, sampling)
        self.records[tuple(prompt_ids), sampling.seed] = (sampling, completion)
        return completion


class AlwaysRaisingCalculator:
    """The calculator's name and schema, but every call raises (and it has no create() or reward())."""
    name = "calculator"
    released = 0

    def __init__(self):
        from turnrl.env.builtin.calculator import Calculator
        self.schema = Calculator.schema

    def execute(self, args):
        raise RuntimeError("calculator backend down")

    def release(self):
        AlwaysRaisingCalculator.released += 1


SINGLE_TURN = [{"role": "user", "content": "Name one colour. Answer in one word."},
               {"role": "user", "content": "Write a long poem about the sea."}]


@pytest.fixture(scope="session")
def real_rollouts(smol_engine, smol_template):
    """Every real-model rollout scenario of these tests, run concurrently so the engine decodes them together
    (on a CPU a decode step costs about the same for 2 rows as for 20). Returns {scenario: (loop, trajs)}.

    calculator: the built-in task with a worked example, built-in environment, 3 tasks x 2, temperature 0.7.
    raising:    the same prompts, a calculator that always raises, greedy, 2 tasks x 1.
    interactive: feedback_math (2) and guess_number (1) with their built-in simulated users, x 2.
    tight:      guess_number x 2 with little context left, and single-turn rows (no tools, no interaction).
    Also: "records", {(prompt ids, seed): (sampling, completion)} of every request, and "raising_released".
    """
    from turnrl.config.schema import RolloutConfig
    from turnrl.data import Task, load_dataset
    from turnrl.chat.parsers import get_parser
    from turnrl.rollout.factory import build_environment
    from turnrl.rollout.scheduler import run_batch

    env = build_environment(RolloutConfig())
    recorder = RecordingEngine(smol_engine)

    def loop(environment, limits, sampling, seed=0):
        return AgentLoop(recorder, smol_template, get_parser("hermes"), environment, limits, sampling, seed=seed)

    calculator = load_dataset(task="calculator", size=3, seed=0, options={"demo": True})
    interactive = (load_dataset(task="feedback_math", size=2, seed=0)
                   + load_dataset(task="guess_number", size=1, seed=0))
    tight = load_dataset(task="guess_number", size=1, seed=1) + [
        Task(uid=f"single-{i}", messages=[m], tools=None) for i, m in enumerate(SINGLE_TURN)]
    guess_prompt = len(smol_template.encode(smol_template.render(tight[0].messages, add_generation_prompt=True)))
    scenarios = {
        "calculator": (loop(env, Limits(max_assistant_turns=2), Sampling(max_tokens=64, temperature=0.7)),
                       calculator, 2),
        "raising": (loop(Environment({"calculator": AlwaysRaisingCalculator}), Limits(max_assistant_turns=2),
                         Sampling(max_tokens=48, temperature=0.0)), calculator[:2], 1),
        "interactive": (loop(env, Limits(max_assistant_turns=3, max_response_tokens=200),
                             Sampling(max_tokens=24, temperature=0.7)), interactive, 2),
        "tight": (loop(env, Limits(max_assistant_turns=8, max_user_turns=8, max_context_tokens=guess_prompt + 30),
                       Sampling(max_tokens=24, temperature=0.7), seed=1), tight, 2),
    }

    async def everything():
        results = await asyncio.gather(*(run_batch(lp, tasks, n, concurrency=64)
                                         for lp, tasks, n in scenarios.values()))
        return {name: (scenarios[name][0], trajs) for name, trajs in zip(scenarios, results)}
    AlwaysRaisingCalculator.released = 0
    out = asyncio.run(everything())
    out["records"] = recorder.records
    out["raising_released"] = AlwaysRaisingCalculator.released
    return out
