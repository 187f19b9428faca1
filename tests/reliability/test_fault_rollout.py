"""Fault injection during real rollouts: one batch in which each trajectory breaks one thing.

Builds on tests/rollout/test_faults.py (a tool that raises, hangs or floods; malformed JSON, unknown tools,
bad arguments; an interaction that raises; an engine error), with the faults it does not cover. Every
trajectory must end with a termination and its ledger invariants; environment faults are recorded and
masked, the policy's own mistakes are recorded and stay in the loss, and the batch summary counts them.
"""

import asyncio
import json
import os
import signal
import threading
import time

import pytest

from turnrl.config.schema import ToolSpec
from turnrl.data import Task
from turnrl.env.interactions import Reply
from turnrl.env.loading import tool_factory
from turnrl.env.sandbox import SandboxSettings, pool_for
from turnrl.env.tools import ToolOutput
from turnrl.ledger import Source
from turnrl.rollout.loop import Environment, Limits
from turnrl.rollout.scheduler import run_batch, summarize

from fault_engine import Turn

NO_ARGS = {"type": "object", "properties": {}}
CODE = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
CRASHY = SandboxSettings(timeout_s=3.0, workers=1)      # its own pool: the test kills that pool's worker


def schema(name, params=NO_ARGS):
    return {"type": "function", "function": {"name": name, "description": name, "parameters": params}}


def call(name, **args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


class BytesTool:
    name, schema = "bytes_out", schema("bytes_out")

    def execute(self, args):
        return b"\xff\xfe result \x80"             # not UTF-8


class SurrogateTool:
    name, schema = "surrogate_out", schema("surrogate_out")

    def execute(self, args):
        return "name: caf\udce9"                    # os.fsdecode of a latin-1 file name


class NanRewardTool:
    name, schema = "nan_reward", schema("nan_reward")

    def execute(self, args):
        return ToolOutput("fine", reward=float("nan"))


class User:
    """A simulated user that answers `reply` (or sleeps `delay` seconds first) and ends with `final`."""

    def __init__(self, reply=None, delay=0.0, final=None):
        self.reply, self.delay, self.final = reply, delay, final

    def start(self, **kwargs):
        pass

    async def respond(self, messages):
        await asyncio.sleep(self.delay)
        return self.reply

    def finish(self):
        return self.final


USERS = {
    "slow_user": lambda: User("ok", delay=30),
    "int_user": lambda: User(42),
    "none_text_user": lambda: User(Reply(None)),
    "nan_reward_user": lambda: User(Reply("try again", reward=float("nan"))),
    "inf_final_user": lambda: User(Reply("correct", done=True), final=float("inf")),
}

CASES = {
    # tag: (tools, interaction, script)
    "healthy": (["calculator"], None, [call("calculator", expression="2 + 2"), "#### 4"]),
    "bytes_output": (["bytes_out"], None, [call("bytes_out"), "Odd output."]),
    "surrogate_output": (["surrogate_out"], None, [call("surrogate_out"), "A name."]),
    "nan_step_reward": (["nan_reward"], None, [call("nan_reward"), "Done."]),
    "python_ok": (["python"], None, [call("python", code="print(6 * 7)"), "#### 42"]),
    "python_kills_itself": (["python"], None, [call("python", code="import os\nos.kill(os.getpid(), 9)"), "Hm."]),
    "python_worker_crash": (["python_crashy"], None, [call("python_crashy", code="import time\ntime.sleep(2.5)"),
                                                      "It crashed."]),
    "partial_call": (["calculator"], None, [Turn('<tool_call>\n{"name": "calculator", "arguments": {"expre',
                                                 finish="length"), "#### 1"]),
    "call_in_think": (["calculator"], None, [
        "<think>I could " + call("calculator", expression="2 + 2") + " but it is easy.</think>\n#### 4"]),
    "call_in_open_think": (["calculator"], None, ["<think>Let me try " + call("calculator", expression="1")]),
    "endless_tools": (["calculator"], None, [call("calculator", expression="1 + 1")]),
    "endless_text": ([], None, [Turn("and so on " * 80, finish="length")]),
    "user_times_out": ([], {"name": "slow_user"}, ["#### 3"]),
    "user_returns_int": ([], {"name": "int_user"}, ["#### 3"]),
    "user_returns_none_text": ([], {"name": "none_text_user"}, ["#### 3"]),
    "user_nan_reward": ([], {"name": "nan_reward_user"}, ["#### 3"]),
    "user_inf_final": ([], {"name": "inf_final_user"}, ["#### 3"]),
    "engine_abort": ([], None, [Turn("The answer is", finish="abort")]),
    "engine_raises": ([], None, [RuntimeError("CUDA error: an illegal memory access was encountered")]),
    "engine_bad_logprobs": ([], None, [Turn(ids=[504, 1152, 28], logprobs=[-0.1], finish="stop")]),
}
MASKED = {"nan_step_reward", "python_worker_crash", "user_times_out", "user_returns_int", "user_returns_none_text",
          "user_nan_reward", "user_inf_final", "engine_abort", "engine_raises", "engine_bad_logprobs"}


def environment():
    crashy = ToolSpec(class_name="python", config={"timeout_s": CRASHY.timeout_s, "workers": CRASHY.workers},
                      tool_schema=schema("python_crashy", CODE))
    tools = {"calculator": tool_factory(ToolSpec(class_name="calculator"))[1],
             "python": tool_factory(ToolSpec(class_name="python", config={"timeout_s": 2.0, "workers": 2}))[1],
             "python_crashy": tool_factory(crashy)[1],
             "bytes_out": BytesTool, "surrogate_out": SurrogateTool, "nan_reward": NanRewardTool}
    return Environment(tools, dict(USERS), tool_timeout_s=6.0, max_tool_response_tokens=64, interaction_timeout_s=3.0)


def kill_the_crashy_worker_when_busy():
    pool = pool_for(CRASHY)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        busy = pool.busy_pids()
        if busy:
            time.sleep(0.3)
            os.killpg(busy[0], signal.SIGKILL)
            return
        time.sleep(0.02)


@pytest.fixture(scope="module")
def batch(fault_loop):
    tasks = [Task(uid=tag, messages=[{"role": "user", "content": f"[case:{tag}] Go."}], tools=tools,
                  interaction=interaction, ground_truth="4")
             for tag, (tools, interaction, _) in CASES.items()]
    loop = fault_loop({tag: script for tag, (_, _, script) in CASES.items()}, environment(),
                      Limits(max_assistant_turns=3, max_response_tokens=400))
    killer = threading.Thread(target=kill_the_crashy_worker_when_busy)
    killer.start()
    start = time.perf_counter()
    trajs = asyncio.run(run_batch(loop, tasks, n=1, concurrency=32))
    seconds = time.perf_counter() - start
    killer.join()
    return {t.group_id: t for t in trajs}, seconds


def kinds(traj):
    return [(e.kind, e.blame) for e in traj.errors]


def test_every_trajectory_ends_with_its_invariants_and_only_environment_faults_are_masked(batch):
    trajs, seconds = batch
    assert sorted(trajs) == sorted(CASES)
    for tag, traj in trajs.items():
        traj.check()
        assert traj.termination, tag
        assert traj.masked == (tag in MASKED), (tag, traj.errors)
        assert traj.masked == any(e.blame == "environment" for e in traj.errors), tag
    assert seconds < 20              # the slow user and the sandbox cost their timeouts, not the batch's


def test_the_rest_of_the_batch_is_untouched(batch):
    healthy = batch[0]["healthy"]
    assert healthy.errors == [] and healthy.termination == "eos" and healthy.parity == "exact"
    assert healthy.turns[0].tool_results[0].text == "4"


@pytest.mark.parametrize("tag, fragment", [("bytes_output", "\ufffd\ufffd result \ufffd"),
                                           ("surrogate_output", "name: caf\ufffd")])
def test_output_that_is_not_valid_unicode_is_decoded_not_fatal(batch, tag, fragment):
    traj = batch[0][tag]
    assert traj.errors == [] and traj.termination == "eos" and traj.parity in ("exact", "token_drift")
    assert traj.turns[0].tool_results[0].text == fragment and traj.n_tokens(Source.TOOL) > 0


def test_a_non_finite_step_reward_is_an_environment_error(batch):
    traj = batch[0]["nan_step_reward"]
    assert kinds(traj) == [("tool_error", "environment")]
    assert "the step reward must be a finite number, got nan" in traj.errors[0].message
    assert traj.turns[0].tool_reward == 0.0


def test_sandboxed_code_that_crashes_is_output_but_a_crashed_worker_is_an_error(batch):
    trajs = batch[0]
    assert trajs["python_ok"].turns[0].tool_results[0].text == "42\n" and not trajs["python_ok"].masked
    own = trajs["python_kills_itself"]
    assert own.errors == [] and own.turns[0].tool_results[0].text == "[killed by SIGKILL]"
    crash = trajs["python_worker_crash"]
    assert kinds(crash) == [("tool_error", "environment")] and "died during the call" in crash.errors[0].message
    assert crash.termination == "eos" and len(crash.turns) == 2           # the model was told and went on
    assert pool_for(CRASHY).run("print('replaced')").output == "replaced\n"


def test_partial_and_hidden_tool_calls(batch):
    trajs = batch[0]
    partial = trajs["partial_call"]
    assert kinds(partial) == [("tool_parse", "policy")] and partial.turns[0].finish_reason == "length"
    assert partial.errors[0].message == "unterminated <tool_call> (no </tool_call>)"
    assert partial.messages[-2]["content"] == "Error: unterminated <tool_call> (no </tool_call>)"
    for tag in ("call_in_think", "call_in_open_think"):
        traj = trajs[tag]
        assert traj.errors == [] and traj.termination == "eos" and len(traj.turns) == 1
        assert traj.turns[0].tool_calls == [] and traj.n_tokens(Source.TOOL) == 0


def test_endless_turns_stop_at_the_limits(batch):
    tools = batch[0]["endless_tools"]
    assert tools.termination == "max_assistant_turns" and len(tools.turns) == 3 and tools.errors == []
    text = batch[0]["endless_text"]
    assert text.termination == "token_budget" and text.turns[0].finish_reason == "length"
    assert text.n_tokens(Source.POLICY) == 64


@pytest.mark.parametrize("tag, message", [
    ("user_times_out", "respond failed: timed out"),
    ("user_returns_int", "respond failed: TypeError: an interaction's respond() must return Reply"),
    ("user_returns_none_text", "respond failed: TypeError: the reply's text must be a string, got NoneType"),
    ("user_nan_reward", "respond failed: ValueError: the reply's reward must be a finite number, got nan"),
    ("user_inf_final", "finish failed: ValueError: the final reward must be a finite number, got inf"),
])
def test_a_broken_simulated_user_is_an_environment_error(batch, tag, message):
    traj = batch[0][tag]
    assert kinds(traj) == [("interaction", "environment")] and traj.errors[0].message.startswith(message)
    assert len(traj.turns) == 1 and "interaction" not in traj.reward_parts
    assert all(t.user_reward == 0.0 for t in traj.turns)


@pytest.mark.parametrize("tag, kind, message", [
    ("engine_abort", "engine", "request aborted"),
    ("engine_raises", "internal", "RuntimeError: CUDA error: an illegal memory access"),
    ("engine_bad_logprobs", "internal", "LedgerError: policy tokens need one logprob each"),
])
def test_engine_faults(batch, tag, kind, message):
    traj = batch[0][tag]
    assert kinds(traj) == [(kind, "environment")] and traj.errors[0].message.startswith(message)
    assert traj.termination == "error"


def test_the_summary_counts_every_failure(batch):
    s = summarize(list(batch[0].values()), 1.0)
    assert s["trajectories"] == len(CASES) and s["masked"] == len(MASKED)
    assert s["errors/tool_error"] == 2 and s["errors/tool_parse"] == 1
    assert s["errors/interaction"] == 5 and s["errors/engine"] == 1 and s["errors/internal"] == 2
    assert s["termination/max_assistant_turns"] == 1 and s["termination/error"] == 7
