"""Agents as the rollout: entrypoints and commands, run through the gateway, scored, and trained on."""

import asyncio
import json
import sys
from pathlib import Path

from turnrl.chat.parsers import get_parser
from turnrl.data.rows import Task
from turnrl.gateway.agents import AgentRollout, agent_reward, parse_reward
from turnrl.gateway.service import Defaults, Gateway
from turnrl.ledger import Source
from turnrl.rewards.functions import load_reward_function, score_all
from tests.gateway.conftest import ScriptedEngine

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
TASK = Task("t17", [{"role": "user", "content": "What is 17 * 23? Use the calculator tool, then answer as '#### N'."}],
            ground_truth=391)
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>'


def rollout(template, texts, **kw):
    gateway = Gateway(ScriptedEngine(template, texts), template, get_parser("hermes"), ["policy"], Defaults(),
                      "split", pin_sampling=True)
    return AgentRollout(gateway, **kw)


def run_batch(agents, tasks, n):
    async def go():
        try:
            return await agents.run_batch(tasks, n, concurrency=4, policy_version=3)
        finally:
            await agents.close()
    return asyncio.run(go())


def test_openai_sdk_example_is_recorded_and_scored_by_reward_functions(smol_template):
    agents = rollout(smol_template, [CALL, "The calculator says 391.\n#### 391"],
                     entrypoint=str(ROOT / "examples/agents/openai_sdk/agent.py") + ":run")
    [traj] = run_batch(agents, [TASK], 1)
    assert traj.parity == "exact" and not traj.errors and traj.policy_version == 3
    assert [t.tool_results[0].text for t in traj.turns[:1]] == ["391"]
    assert traj.n_tokens(Source.TOOL) > 0 and len(traj.turns) == 2
    functions = [load_reward_function("exact_answer", 0.8), load_reward_function("tool_success", 0.2)]
    asyncio.run(score_all([traj], functions))
    assert traj.reward == 1.0 and traj.group_id == "t17" and traj.info["ground_truth"] == 391


def test_returned_rewards_sync_agents_and_n_sessions_per_row(smol_template):
    agents = rollout(smol_template, ["#### 391"], entrypoint="tests.gateway.agents_for_tests:answer_once")
    trajs = run_batch(agents, [TASK, Task("t2", [{"role": "user", "content": "hi"}])], 3)
    assert [(t.group_id, t.sample_index) for t in trajs] == [("t17", 0), ("t17", 1), ("t17", 2), ("t2", 0),
                                                              ("t2", 1), ("t2", 2)]
    assert len({t.info["session"] for t in trajs}) == 6
    asyncio.run(score_all(trajs, [agent_reward(1.0)]))
    assert all(t.reward == 1.0 and t.reward_parts["agent"] == 1.0 for t in trajs)
    sync = rollout(smol_template, ["yes"], entrypoint="tests.gateway.agents_for_tests:sync_agent")
    [traj] = run_batch(sync, [TASK], 1)
    assert traj.info["agent_reward"] == 1.0 and traj.metrics["gateway/calls"] == 1


def test_agent_failures_are_data_and_the_batch_goes_on(smol_template):
    results = {}
    for name, timeout in (("crashes", 30.0), ("hangs", 0.5), ("returns_text", 30.0)):
        agents = rollout(smol_template, ["x"], entrypoint=f"tests.gateway.agents_for_tests:{name}", timeout_s=timeout)
        [traj] = run_batch(agents, [TASK], 1)
        results[name] = traj
    assert results["crashes"].masked and "fell over" in results["crashes"].errors[-1].message
    assert results["crashes"].turns   # what it sampled before crashing is kept, for the viewer
    assert results["hangs"].masked and "timed out" in results["hangs"].errors[-1].message
    assert "returned 'great'" in results["returns_text"].errors[-1].message
    no_reward = results["crashes"]
    asyncio.run(score_all([no_reward], [agent_reward(1.0)]))
    assert any(e.kind == "reward" for e in no_reward.errors)


def test_command_agent_gets_its_session_from_the_environment(smol_template):
    agents = rollout(smol_template, ["hello"], command=[sys.executable, str(HERE / "agents_for_tests.py")],
                     env={"PYTHONPATH": str(ROOT)})
    [traj] = run_batch(agents, [TASK], 1)
    assert not traj.errors and traj.info["agent_reward"] == 0.5 and traj.metrics["gateway/calls"] == 1
    failing = rollout(smol_template, ["x"], command=[sys.executable, "-c", "import sys; sys.exit('no luck')"])
    [bad] = run_batch(failing, [TASK], 1)
    assert bad.masked and "exited with 1" in bad.errors[-1].message and "no luck" in bad.errors[-1].message


def test_reward_lines():
    assert parse_reward("log\n0.75\n") == 0.75
    assert parse_reward(json.dumps({"reward": 1})) == 1.0
    assert parse_reward("done") is None and parse_reward("") is None and parse_reward("true") is None
