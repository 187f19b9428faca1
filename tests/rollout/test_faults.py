"""Faults are data: each broken tool, call, interaction or engine request is recorded on its own trajectory
(environment faults masked, policy faults kept in the loss) while the rest of the batch runs normally."""

import asyncio
import json
import time

import pytest

from turnrl.config.schema import InteractionSpec, ToolSpec
from turnrl.data import Task
from turnrl.engines.base import EngineError
from turnrl.env.loading import interaction_factory, tool_factory
from turnrl.ledger import Source
from turnrl.rollout.loop import Environment, Limits
from turnrl.rollout.scheduler import run_batch, summarize

NO_ARGS = {"type": "object", "properties": {}}


def schema(name):
    return {"type": "function", "function": {"name": name, "description": name, "parameters": NO_ARGS}}


class Tracked:
    """Counts lifecycle calls per instance, across all trajectories."""
    instances = []

    def __init__(self):
        self.calls = {"create": 0, "execute": 0, "reward": 0, "release": 0}
        type(self).instances.append(self)

    def create(self, **kwargs):
        self.calls["create"] += 1

    def reward(self):
        self.calls["reward"] += 1
        return None

    def release(self):
        self.calls["release"] += 1


class Boom(Tracked):
    name, schema = "boom", schema("boom")
    instances = []

    def execute(self, args):
        self.calls["execute"] += 1
        raise RuntimeError("disk on fire")


class Sleepy(Tracked):
    name, schema = "sleepy", schema("sleepy")
    instances = []

    async def execute(self, args):
        self.calls["execute"] += 1
        await asyncio.sleep(30)
        return "too late"


class Flood(Tracked):
    name, schema = "flood", schema("flood")
    instances = []

    def execute(self, args):
        self.calls["execute"] += 1
        return "lorem ipsum dolor " * 58_000          # ~1 MB


class BadRespond:
    def start(self, **kwargs):
        pass

    def respond(self, messages):
        raise RuntimeError("user simulator crashed")

    def finish(self):
        return None


class BadStart(BadRespond):
    def start(self, **kwargs):
        raise ConnectionError("user simulator unreachable")


def call(name, **args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


CASES = {
    # tag: (tools, interaction, script)
    "normal_tool": (["calculator"], None, [call("calculator", expression="6 * 7"), "The result is 42.\n#### 42"]),
    "raise_tool": (["boom"], None, [call("boom"), "The tool failed."]),
    "hang_tool": (["sleepy"], None, [call("sleepy"), "The tool is slow."]),
    "flood_tool": (["flood"], None, [call("flood"), "That is a lot of text."]),
    "bad_json": (["calculator"], None, ['<tool_call>\n{"name": "calculator", "arguments": {expression: 1}}\n</tool_call>',
                                        "#### 1"]),
    "unknown_tool": (["calculator"], None, [call("weather", city="Oslo"), "#### 1"]),
    "bad_args": (["calculator"], None, [call("calculator", expr="1 + 1"), "#### 2"]),
    "respond_raises": ([], {"name": "bad_respond"}, ["5"]),
    "start_raises": ([], {"name": "bad_start"}, ["5"]),
    "engine_error": ([], None, [EngineError("backend exploded")]),
    "normal_user": ([], {"name": "math_feedback", "ground_truth": "7"}, ["7"]),
}


def tasks():
    return [Task(uid=tag, messages=[{"role": "user", "content": f"[case:{tag}] Please help."}], tools=tools,
                 interaction=interaction, ground_truth="1")
            for tag, (tools, interaction, _) in CASES.items()]


def environment(**changes):
    tools = {"calculator": tool_factory(ToolSpec(class_name="calculator"))[1], "boom": Boom, "sleepy": Sleepy,
             "flood": Flood}
    interactions = {"math_feedback": interaction_factory(InteractionSpec("math_feedback", "math_feedback")),
                    "bad_respond": BadRespond, "bad_start": BadStart}
    settings = dict(tool_timeout_s=1.0, max_tool_response_tokens=64)
    settings.update(changes)
    return Environment(tools, interactions, **settings)


@pytest.fixture(scope="module")
def faulty_batch(scripted, make_loop):
    for cls in (Boom, Sleepy, Flood):
        cls.instances.clear()
    engine = scripted({tag: script for tag, (_, _, script) in CASES.items()})
    loop = make_loop(engine, environment(), Limits(max_assistant_turns=3))
    t0 = time.perf_counter()
    trajs = asyncio.run(run_batch(loop, tasks(), n=1, concurrency=32))
    return {t.group_id: t for t in trajs}, engine, time.perf_counter() - t0


def errors(traj):
    return [(e.kind, e.blame) for e in traj.errors]


def test_every_trajectory_finishes_and_keeps_its_ledger_invariants(faulty_batch, smol_template):
    trajs, _, seconds = faulty_batch
    assert sorted(trajs) == sorted(CASES)
    for tag, traj in trajs.items():
        traj.check()
        assert traj.termination, tag
        if traj.turns:
            assert traj.parity in ("exact", "token_drift"), (tag, traj.parity)
            text = smol_template.decode(traj.segment.token_ids)
            assert text == smol_template.render(traj.messages, None, add_generation_prompt=False)
    assert seconds < 20          # the hanging tool (30 s) costs its timeout, not the batch


def test_normal_trajectories_complete_cleanly(faulty_batch):
    trajs, _, _ = faulty_batch
    tool = trajs["normal_tool"]
    assert tool.termination == "eos" and tool.errors == [] and not tool.masked
    assert tool.turns[0].tool_results[0].text == "42" and tool.turns[1].text == "The result is 42.\n#### 42"
    assert tool.n_tokens(Source.TOOL) > 0
    user = trajs["normal_user"]
    assert user.termination == "interaction_done" and not user.masked and user.reward_parts == {"interaction": 1.0}


def test_raising_tool_is_an_environment_error_and_is_released(faulty_batch):
    traj = faulty_batch[0]["raise_tool"]
    assert errors(traj) == [("tool_error", "environment")] and traj.masked
    result = traj.turns[0].tool_results[0]
    assert result.error == "tool 'boom' raised RuntimeError: disk on fire"
    assert traj.messages[-2]["content"] == "Error: tool 'boom' raised RuntimeError: disk on fire"
    assert traj.termination == "eos" and len(traj.turns) == 2     # the model was told and answered
    (boom,) = Boom.instances
    assert boom.calls == {"create": 1, "execute": 1, "reward": 1, "release": 1}


def test_hanging_tool_times_out(faulty_batch):
    traj = faulty_batch[0]["hang_tool"]
    assert errors(traj) == [("tool_timeout", "environment")] and traj.masked
    result = traj.turns[0].tool_results[0]
    assert result.error == "tool 'sleepy' timed out after 1s" and 1.0 <= result.seconds < 5
    assert Sleepy.instances[0].calls["release"] == 1


def test_flooding_tool_is_truncated_not_an_error(faulty_batch, smol_template):
    traj = faulty_batch[0]["flood_tool"]
    assert traj.errors == [] and not traj.masked and traj.termination == "eos"
    result = traj.turns[0].tool_results[0]
    assert result.truncated and result.error is None
    assert len(smol_template.encode(result.text)) <= 64 and "tokens truncated]..." in result.text
    assert traj.n_tokens(Source.TOOL) <= 64 + 8       # the tool message's role header and end token


@pytest.mark.parametrize("tag, message", [
    ("bad_json", "malformed JSON in <tool_call>: Expecting property name enclosed in double quotes"),
    ("unknown_tool", "unknown tool 'weather'; available tools: calculator"),
    ("bad_args", "missing required argument(s): expression"),
])
def test_bad_calls_are_policy_errors_that_stay_in_the_loss(faulty_batch, tag, message):
    traj = faulty_batch[0][tag]
    assert errors(traj) == [("tool_parse", "policy")] and not traj.masked
    assert traj.errors[0].message == message and traj.errors[0].turn == 0
    assert traj.messages[-2]["content"] == f"Error: {message}"           # the model sees what went wrong
    assert traj.termination == "eos" and len(traj.turns) == 2
    assert all(traj.segment.loss_mask[i] for i in range(traj.turns[0].start, traj.turns[0].end))


def test_interaction_failures(faulty_batch):
    trajs, engine, _ = faulty_batch
    respond = trajs["respond_raises"]
    assert errors(respond) == [("interaction", "environment")] and respond.masked
    assert respond.termination == "error" and len(respond.turns) == 1
    assert respond.errors[0].message == "respond failed: RuntimeError: user simulator crashed"
    start = trajs["start_raises"]
    assert errors(start) == [("interaction", "environment")] and start.masked and start.termination == "error"
    assert start.errors[0].message == "start failed: ConnectionError: user simulator unreachable"
    assert start.turns == [] and "start_raises" not in {tag for tag, _, _ in engine.requests}


def test_engine_error_is_recorded(faulty_batch):
    traj = faulty_batch[0]["engine_error"]
    assert errors(traj) == [("engine", "environment")] and traj.masked
    assert traj.termination == "error" and traj.errors[0].message == "backend exploded" and traj.turns == []


def test_summary_counts_the_faults(faulty_batch):
    trajs, _, _ = faulty_batch
    summary = summarize(list(trajs.values()), 1.0)
    assert summary["trajectories"] == len(CASES)
    assert summary["masked"] == 5          # raise, hang, respond, start, engine; none of the policy's errors
    assert summary["errors/tool_parse"] == 3 and summary["errors/tool_error"] == 1
    assert summary["errors/tool_timeout"] == 1 and summary["errors/interaction"] == 2
    assert summary["errors/engine"] == 1 and summary["tool_errors"] == 5


def test_tool_errors_not_shown_to_the_model_end_the_trajectory(scripted, make_loop):
    engine = scripted({"raise_tool": CASES["raise_tool"][2], "bad_args": CASES["bad_args"][2]})
    loop = make_loop(engine, environment(tool_errors_to_model=False))
    picked = [t for t in tasks() if t.uid in ("raise_tool", "bad_args")]
    raised, bad = asyncio.run(run_batch(loop, picked, n=1, concurrency=4))
    assert raised.termination == "error" and raised.masked and len(raised.turns) == 1
    assert bad.termination == "error" and not bad.masked and errors(bad) == [("tool_parse", "policy")]


@pytest.mark.slow
def test_raising_tool_with_the_real_model(real_rollouts):
    """SmolLM2 calls the calculator after a worked example; this calculator always raises
    (the `raising` scenario of conftest's real_rollouts)."""
    _, trajs = real_rollouts["raising"]
    called = [t for t in trajs if any(turn.tool_results for turn in t.turns)]
    assert called, [t.turns[0].text for t in trajs]
    for traj in trajs:
        traj.check()
        assert traj.parity in ("exact", "token_drift")
        assert traj.masked == any(e.blame == "environment" for e in traj.errors)
    raised_any = False
    for traj in called:
        raised = [r for turn in traj.turns for r in turn.tool_results
                  if r.error and "calculator backend down" in r.error]
        if raised:
            raised_any = True
            assert ("tool_error", "environment") in errors(traj) and traj.masked
            assert raised[0].text == "Error: tool 'calculator' raised RuntimeError: calculator backend down"
            assert traj.n_tokens(Source.TOOL) > 0 and len(traj.turns) == 2   # the model was told and went on
    assert raised_any
    assert real_rollouts["raising_released"] == len(trajs)         # release() ran once per trajectory
