"""MCP servers as tools, against a real SDK server (tests/env/mcp_server.py) over stdio and streamable HTTP,
through the real agent loop with a scripted policy (SmolLM2's tokenizer and template, hermes tool calls)."""

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from turnrl.chat.parsers import HermesParser
from turnrl.config.loader import ConfigError
from turnrl.config.schema import RolloutConfig, ToolSpec
from turnrl.data.rows import Task
from turnrl.engines.base import Sampling
from turnrl.env.mcp_tools import openai_schema
from turnrl.rollout.factory import build_environment
from turnrl.rollout.loop import AgentLoop, Limits

from scripted import ScriptedPolicy, call

pytest.importorskip("mcp")

SERVER = str(Path(__file__).with_name("mcp_server.py"))
STDIO = {"command": [sys.executable, SERVER, "stdio"]}
# Starting a Python MCP server takes seconds on a busy 2-core machine; create() runs under the tool timeout.
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def http_url():
    """The test server over streamable HTTP on a free loopback port, for this module."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, SERVER, "http", str(port)], stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the MCP test server did not start listening")
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(10)


def rollout(template, tool_config, scripts, n=1, timeout_s=TIMEOUT_S, **config):
    """Run each scripted case `n` times concurrently through the agent loop with the configured MCP tools."""
    cfg = RolloutConfig(tools=[ToolSpec("mcp", dict(tool_config, **config))], tool_timeout_s=timeout_s)
    env = build_environment(cfg)
    loop = AgentLoop(ScriptedPolicy(template, scripts), template, HermesParser(), env,
                     Limits(max_assistant_turns=5, max_user_turns=5), Sampling(max_tokens=128))
    tasks = [Task(uid=tag[6:-1], messages=[{"role": "user", "content": f"{tag} go"}]) for tag in scripts]

    async def everything():
        return await asyncio.gather(*(loop.run(t, k) for t in tasks for k in range(n)))
    return asyncio.run(everything())


def tool_texts(traj):
    return [r.text for turn in traj.turns for r in turn.tool_results]


def gone(pid, wait_s=10.0):
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


COUNTING = [call("count"), call("count") + call("pid"), call("count"), "done"]


# -- discovery and schemas ------------------------------------------------------------------------------------
def test_stdio_server_tools_are_listed_with_openai_schemas():
    env = build_environment(RolloutConfig(tools=[ToolSpec("mcp", STDIO)]))
    assert env.default_tools == ["add", "count", "pid", "fail", "crash", "hang"]
    add = env.tool_factories["add"]()
    assert add.schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}}


def test_filter_and_prefix(http_url):
    env = build_environment(RolloutConfig(tools=[ToolSpec("mcp", {"url": http_url, "tools": ["add", "count"],
                                                                  "prefix": "srv_"})]))
    assert env.default_tools == ["srv_add", "srv_count"]
    assert env.tool_factories["srv_count"]().schema["function"]["name"] == "srv_count"


def test_schema_conversion_keeps_a_property_named_title():
    class Listed:
        name, title, description = "note", None, None
        input_schema = {"$schema": "x", "title": "noteArguments", "type": "object",
                        "properties": {"title": {"title": "Title", "type": "string"}}}
    fn = openai_schema(Listed, "note")["function"]
    assert fn["description"] == "note"
    assert fn["parameters"] == {"type": "object", "properties": {"title": {"type": "string"}}}


@pytest.mark.parametrize("config, message", [
    ({}, "exactly one of 'command'"),
    ({"command": ["x"], "url": "http://127.0.0.1:1/mcp"}, "exactly one of 'command'"),
    ({"url": "ftp://host/mcp"}, "must start with http"),
    ({"command": ["x"], "sesion": "shared"}, r"Did you mean '.*config.session'"),
    ({"command": ["x"], "session": "per_call"}, "session"),
    ({"url": "http://127.0.0.1:1/mcp", "cwd": "/tmp"}, "for stdio servers"),
])
def test_bad_config_is_refused(config, message):
    with pytest.raises(ConfigError, match=message):
        build_environment(RolloutConfig(tools=[ToolSpec("mcp", config)]))


def test_server_that_cannot_start_or_lacks_a_tool_is_a_config_error(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import sys\nprint('missing dependency: frobnicator', file=sys.stderr)\nsys.exit(2)\n")
    with pytest.raises(ConfigError, match="cannot start MCP server.*missing dependency: frobnicator"):
        build_environment(RolloutConfig(tools=[ToolSpec("mcp", {"command": [sys.executable, str(broken)]})]))
    with pytest.raises(ConfigError, match=r"has no tool\(s\) \['search'\]"):
        build_environment(RolloutConfig(tools=[ToolSpec("mcp", dict(STDIO, tools=["search"]))]))
    with pytest.raises(ConfigError, match="tool_schema"):
        build_environment(RolloutConfig(tools=[ToolSpec("mcp", STDIO, tool_schema={"name": "x"})]))


# -- sessions ----------------------------------------------------------------------------------------------------
def test_stdio_session_per_trajectory_keeps_state_and_ends_with_it(smol_template):
    trajs = rollout(smol_template, STDIO, {"[case:counting]": COUNTING}, n=2)
    pids = set()
    for traj in trajs:
        assert not traj.errors and not traj.masked and traj.termination == "eos"
        texts = tool_texts(traj)
        assert [texts[0], texts[1], texts[3]] == ["1", "2", "3"]   # state across calls and turns
        pids.add(int(texts[2]))
    assert len(pids) == 2                                           # one server process per trajectory
    assert all(gone(pid) for pid in pids)                           # each closed at release


def test_http_session_per_trajectory_and_shared(smol_template, http_url):
    per = rollout(smol_template, {"url": http_url}, {"[case:counting]": COUNTING}, n=2)
    for traj in per:
        assert not traj.masked
        texts = tool_texts(traj)
        assert [texts[0], texts[1], texts[3]] == ["1", "2", "3"]
    shared = rollout(smol_template, {"url": http_url, "session": "shared"}, {"[case:counting]": COUNTING}, n=2)
    counts = sorted(int(t) for traj in shared for i, t in enumerate(tool_texts(traj)) if i != 2)
    assert counts == [1, 2, 3, 4, 5, 6]                             # one session: the count goes on


# -- failures ----------------------------------------------------------------------------------------------------
def errors(traj):
    return [(e.kind, e.blame) for e in traj.errors]


def test_error_crash_and_bad_call_over_stdio(smol_template):
    trajs = {t.group_id: t for t in rollout(smol_template, STDIO, {
        "[case:fails]": [call("fail", reason="disk full"), "done"],
        "[case:crashes]": [call("pid"), call("crash"), call("add", a=1, b=2), "done"],
        "[case:bad_call]": [call("add", a=1), "done"],
    })}
    fails = trajs["fails"]
    assert errors(fails) == [("tool_error", "environment")] and fails.masked
    assert "answered with an error" in fails.turns[0].tool_results[0].text
    crashed = trajs["crashes"]
    assert crashed.masked and crashed.termination == "eos"          # the loop went on after the crash
    assert [e.kind for e in crashed.errors] == ["tool_error", "tool_error"]
    assert "not running" in crashed.turns[2].tool_results[0].text   # a dead server is not called again
    assert gone(int(crashed.turns[0].tool_results[0].text))
    bad = trajs["bad_call"]
    assert errors(bad) == [("tool_parse", "policy")] and not bad.masked


def test_hang_times_out(smol_template, http_url):
    hung = rollout(smol_template, {"url": http_url}, {"[case:hangs]": [call("hang"), "done"]}, timeout_s=10)[0]
    assert errors(hung) == [("tool_timeout", "environment")] and hung.masked and hung.termination == "eos"


def test_a_shared_server_restarts_after_a_crash(smol_template):
    cfg = RolloutConfig(tools=[ToolSpec("mcp", dict(STDIO, session="shared"))], tool_timeout_s=TIMEOUT_S)
    env = build_environment(cfg)
    policy = ScriptedPolicy(smol_template, {"[case:crash]": [call("pid"), call("crash"), "done"],
                                            "[case:after]": [call("pid"), call("count"), "done"]})
    loop = AgentLoop(policy, smol_template, HermesParser(), env, Limits(), Sampling(max_tokens=128))

    async def one_after_another():
        first = await loop.run(Task(uid="crash", messages=[{"role": "user", "content": "[case:crash] go"}]))
        second = await loop.run(Task(uid="after", messages=[{"role": "user", "content": "[case:after] go"}]))
        return first, second
    first, second = asyncio.run(one_after_another())
    assert first.masked and second.errors == [] and not second.masked
    old, new = int(tool_texts(first)[0]), int(tool_texts(second)[0])
    assert old != new and gone(old)                                  # a new server process
    assert tool_texts(second)[1] == "1"                              # with fresh state
