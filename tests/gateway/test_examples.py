"""The example agents (examples/agents/*) with their real client libraries, through the gateway.

First with a scripted policy that calls the calculator and then answers, so every library's round trip is
checked exactly (tool-call JSON re-serialized by the library, results sent back, the replies matched to the
sampled tokens: one branch, no break, parity exact); then once each on SmolLM2 itself."""

import asyncio
from pathlib import Path

import pytest

from turnrl.chat.parsers import get_parser
from turnrl.data import load_dataset
from turnrl.gateway.agents import AgentRollout
from turnrl.gateway.service import Defaults, Gateway
from turnrl.ledger import Source
from tests.gateway.conftest import ScriptedEngine

ROOT = Path(__file__).parent.parent.parent
EXAMPLES = ["openai_sdk", "langgraph", "openai_agents", "pydantic_ai"]


def entrypoint(name):
    return str(ROOT / "examples" / "agents" / name / "agent.py") + ":run"


def run_agents(engine, template, name, tasks, n=1):
    gateway = Gateway(engine, template, get_parser("hermes"), ["policy"], Defaults(max_tokens=48, max_context=2048),
                      "split", pin_sampling=True)
    agents = AgentRollout(gateway, entrypoint(name), timeout_s=600)

    async def go():
        try:
            return await agents.run_batch(tasks, n, concurrency=4)
        finally:
            await agents.close()
    return asyncio.run(go())


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_agent_round_trip_is_token_exact(name, smol_template):
    [task] = load_dataset(task="calculator", size=1, seed=3, options={"demo": True})
    expr = task.messages[-1]["content"].split("What is ")[1].split("?")[0]
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n</tool_call>'
    engine = ScriptedEngine(smol_template, [call, f"The result is {task.ground_truth}.\n#### {task.ground_truth}"])
    [traj] = run_agents(engine, smol_template, name, [task])
    assert not traj.errors, traj.errors
    assert traj.metrics["gateway/calls"] == 2 and traj.metrics["gateway/breaks"] == 0, traj.metrics
    assert len(traj.segments) == 1 and traj.parity == "exact"
    policy = [t for t, s in zip(traj.segment.token_ids, traj.segment.sources) if s == Source.POLICY]
    stop = smol_template.stop_token_ids[0]
    assert policy == smol_template.encode(call) + [stop] + smol_template.encode(
        f"The result is {task.ground_truth}.\n#### {task.ground_truth}") + [stop]
    assert traj.turns[0].tool_results[0].text == str(task.ground_truth)
    if name != "openai_sdk":   # the others return their reward
        assert traj.info["agent_reward"] == 1.0


@pytest.mark.slow
def test_example_agents_run_on_smollm2(smol_hf_engine, smol_template):
    tasks = load_dataset(task="calculator", size=1, seed=4, options={"demo": True})
    for name in EXAMPLES:
        [traj] = run_agents(smol_hf_engine, smol_template, name, tasks)
        assert traj.metrics["gateway/calls"] >= 1, (name, traj.errors)
        assert not [e for e in traj.errors if e.kind == "agent"], (name, traj.errors)
        assert traj.parity in ("exact", "token_drift", "split"), name
        traj.check()
