"""Tools that break the rules of Python or of the tool protocol: each is the tool's failure, recorded on its
trajectory and masked; the run itself never dies of it (issue 17, items 1 and 8)."""

import asyncio
import json

import pytest

from turnrl.data import Task
from turnrl.rollout.loop import Environment, Limits
from turnrl.rollout.scheduler import run_batch

NO_ARGS = {"type": "object", "properties": {}}


def tool(name, fn):
    schema = {"type": "function", "function": {"name": name, "description": name, "parameters": NO_ARGS}}
    return type(name, (), {"name": name, "schema": schema, "execute": lambda self, args: fn()})


def call(name):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': {}})}\n</tool_call>"


class Custom(BaseException):
    pass


def _raise(exc):
    def fn():
        raise exc
    return fn


async def _async_exit(self, args):
    raise SystemExit(1)


ASYNC_EXIT = type("async_exit", (), {"name": "async_exit", "execute": _async_exit,
                                     "schema": tool("async_exit", None).schema})

TOOLS = {
    "argparse_exit": tool("argparse_exit", _raise(SystemExit(2))),       # an argparse CLI on bad arguments
    "ctrl_c": tool("ctrl_c", _raise(KeyboardInterrupt())),
    "custom_base": tool("custom_base", _raise(Custom("not an Exception"))),
    "async_exit": ASYNC_EXIT,
    "returns_none": tool("returns_none", lambda: None),
    "returns_object": tool("returns_object", lambda: object()),
    "returns_list": tool("returns_list", lambda: ["a", "b"]),
    "returns_text": tool("returns_text", lambda: "fine"),
}


def run(fault_loop, names):
    env = Environment({n: TOOLS[n] for n in names}, tool_timeout_s=5.0)
    tasks = [Task(uid=n, messages=[{"role": "user", "content": f"[case:{n}] Go."}], tools=[n]) for n in names]
    loop = fault_loop({n: [call(n), "Done."] for n in names}, env, Limits(max_assistant_turns=3))
    try:
        trajs = asyncio.run(run_batch(loop, tasks, n=1, concurrency=8))
    except BaseException as exc:  # noqa: BLE001 - before the fix, this is the whole run dying
        pytest.fail(f"a tool's {type(exc).__name__} escaped the rollout and would end the run")
    return {t.group_id: t for t in trajs}


@pytest.mark.parametrize("name, what", [("argparse_exit", "SystemExit"), ("ctrl_c", "KeyboardInterrupt"),
                                        ("custom_base", "Custom"), ("async_exit", "SystemExit")])
def test_a_tool_raising_a_base_exception_is_a_tool_error_and_the_run_goes_on(fault_loop, name, what):
    trajs = run(fault_loop, [name, "returns_text"])
    traj = trajs[name]
    assert [(e.kind, e.blame) for e in traj.errors] == [("tool_error", "environment")], traj.errors
    assert what in traj.errors[0].message and traj.masked
    assert traj.termination == "eos" and len(traj.turns) == 2      # the model was told and went on
    ok = trajs["returns_text"]
    assert ok.errors == [] and ok.turns[0].tool_results[0].text == "fine"


@pytest.mark.parametrize("name, type_name", [("returns_none", "NoneType"), ("returns_object", "object"),
                                             ("returns_list", "list")])
def test_a_tool_result_that_is_not_text_is_a_tool_error(fault_loop, name, type_name):
    traj = run(fault_loop, [name])[name]
    assert [(e.kind, e.blame) for e in traj.errors] == [("tool_error", "environment")], traj.errors
    assert type_name in traj.errors[0].message and traj.masked
    result = traj.turns[0].tool_results[0]
    assert result.text.startswith("Error:") and "None" != result.text
