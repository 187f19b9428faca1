"""verifiers environments (tests/env/vf_envs.py, written against the installed release) through turnrl's
agent loop: config expansion, rows, env_response, stop conditions, tools, StatefulToolEnv, rubric, refusals;
a scripted policy on SmolLM2's template for exact behaviour, and a real SmolLM2 rollout end to end."""

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("verifiers")

from turnrl.chat.parsers import HermesParser  # noqa: E402
from turnrl.config import Config  # noqa: E402
from turnrl.config.loader import ConfigError, build  # noqa: E402
from turnrl.data import load_dataset  # noqa: E402
from turnrl.engines.base import Sampling  # noqa: E402
from turnrl.rollout.factory import build_environment  # noqa: E402
from turnrl.rollout.loop import AgentLoop, Limits  # noqa: E402

from scripted import ScriptedPolicy, call  # noqa: E402

ENVS = str(Path(__file__).with_name("vf_envs.py"))
Q1, Q2 = "2 + 3", "4 + 4"


def config(loader, **env):
    return build(Config, {"env": {"verifiers": f"{ENVS}:{loader}", **env}})


def run(template, cfg, scripts, split="train"):
    """Every row of the environment once through the agent loop, scripted per question."""
    d = cfg.data.train if split == "train" else cfg.data.eval
    tasks = load_dataset(d.path, d.task, d.size, d.seed, d.options, d.max_rows)
    env = build_environment(cfg.rollout)
    loop = AgentLoop(ScriptedPolicy(template, scripts), template, HermesParser(), env,
                     Limits(max_assistant_turns=6, max_user_turns=6), Sampling(max_tokens=96))

    async def everything():
        return await asyncio.gather(*(loop.run(t) for t in tasks))
    trajs = asyncio.run(everything())
    return {Q1 if any(Q1 in m["content"] for m in t.messages[:2]) else Q2: t for t in trajs}, env, tasks


def said(traj):
    """What the environment said after the prompt."""
    return [m["content"] for m in traj.messages[1:] if m["role"] != "assistant"]


def test_single_turn_rows_system_prompt_and_weighted_rubric(smol_template):
    cfg = config("load_single", eval=True)
    assert cfg.data.train.task == "verifiers" and cfg.rollout.interactions[0].class_name == "verifiers"
    assert build(Config, {"env": cfg.env.__dict__}).rollout.tools == cfg.rollout.tools   # idempotent
    trajs, env, tasks = run(smol_template, cfg, {Q1: ["5"], Q2: ["It is 7, or maybe not; hard to say really."]})
    assert tasks[0].messages == [{"role": "system", "content": "Answer with a number only."},
                                 {"role": "user", "content": "What is 2 + 3?"}]
    assert tasks[0].ground_truth == "5" and env.default_tools == []
    right, wrong = trajs[Q1], trajs[Q2]
    for t in (right, wrong):
        assert len(t.turns) == 1 and t.termination == "interaction_done" and not t.errors
    assert right.reward_parts["interaction"] == 1.5                       # correct (1.0) + 0.5 * short
    assert right.metrics["interaction/correct"] == 1.0 and right.metrics["interaction/short"] == 1.0
    assert wrong.reward_parts["interaction"] == 0.0
    evals, _, _ = run(smol_template, cfg, {Q1: ["5"]}, split="eval")
    assert list(evals) == [Q1]


def test_multi_turn_env_response_and_stop_conditions(smol_template):
    trajs, _, _ = run(smol_template, config("load_retry"), {Q1: ["7", "6", "5"], Q2: ["8", "thanks"]})
    capped, solved = trajs[Q1], trajs[Q2]
    # max_turns=3: the third answer ends it before another env_response
    assert len(capped.turns) == 3 and said(capped) == ["Wrong (try 1), again.", "Wrong (try 2), again."]
    assert capped.metrics["interaction/tries"] == 2.0 and capped.reward_parts["interaction"] == 1.0
    # verifiers asks the model once more after the env's "Correct." and then its own stop fires
    assert said(solved) == ["Correct."] and len(solved.turns) == 2 and solved.termination == "interaction_done"
    assert solved.metrics["interaction/tries"] == 1.0 and solved.reward_parts["interaction"] == 0.0  # "thanks"


def test_tool_env_runs_its_tools_and_a_raising_tool_masks(smol_template):
    trajs, env, _ = run(smol_template, config("load_tools"), {
        Q1: [call("add", a=2, b=3), "#### 5"],
        Q2: [call("add", a=4, b=4) + call("explode"), call("add", a=4), "8"]})
    assert env.default_tools == ["add", "explode"]
    assert env.tool_factories["add"]().schema["function"]["parameters"]["required"] == ["a", "b"]
    ok, bad = trajs[Q1], trajs[Q2]
    assert [r.text for r in ok.turns[0].tool_results] == ["5"] and ok.turns[0].tool_calls[0].name == "add"
    assert not ok.errors and ok.termination == "interaction_done" and ok.reward_parts["interaction"] == 1.0
    assert [r.text for r in bad.turns[0].tool_results] == ["8", "backend down"]  # verifiers' error_formatter
    assert [(e.kind, e.blame) for e in bad.errors] == [("tool_error", "environment")] and bad.masked
    assert "missing" in bad.turns[1].tool_results[0].text and len(bad.errors) == 1  # a bad call: the policy's


def test_stateful_tool_env_injects_hidden_arguments(smol_template):
    trajs, env, _ = run(smol_template, config("load_vault"), {Q1: [call("peek", slot=1), "done"], Q2: ["done"]})
    params = env.tool_factories["peek"]().schema["function"]["parameters"]
    assert list(params["properties"]) == ["slot"]                          # the model never sees `key`
    assert [r.text for r in trajs[Q1].turns[0].tool_results] == ["slot 1 opened with k5"]
    assert trajs[Q1].reward_parts["interaction"] == 1.0 and trajs[Q2].reward_parts["interaction"] == 0.0


@pytest.mark.parametrize("loader, message", [
    ("load_branching", "get_prompt_messages"),
    ("load_grouped", "group reward functions"),
])
def test_unsupported_environments_are_refused(loader, message):
    cfg = config(loader)
    with pytest.raises(ConfigError, match=message):
        load_dataset(task="verifiers", options=cfg.data.train.options)


def test_bad_env_configs_are_refused():
    with pytest.raises(ConfigError, match="verifiers cannot load environment 'no-such-env'"):
        load_dataset(task="verifiers", options={"env": "no-such-env"})
    with pytest.raises(ConfigError, match="remove data.train.path"):
        build(Config, {"env": {"verifiers": f"{ENVS}:load_single"}, "data": {"train": {"path": "x.jsonl"}}})
    with pytest.raises(ConfigError, match="cannot be called with env.args"):
        load_dataset(task="verifiers", options={"env": f"{ENVS}:load_single", "args": {"colour": "red"}})


@pytest.mark.slow
def test_real_model_rollout_scored_by_the_rubric(tmp_path, torch_threads):
    """`turnrl rollout` with env.verifiers on SmolLM2: every trajectory scored by the environment's rubric."""
    from turnrl.observe.store import read_trajectories
    from turnrl.collect import rollout_to_dir
    cfg = build(Config, {"env": {"verifiers": f"{ENVS}:load_single"}, "engine": {"max_batch_size": 8},
                         "rollout": {"n": 2, "sampling": {"max_tokens_per_turn": 12}}})
    with torch_threads(1):
        summary = asyncio.run(rollout_to_dir(cfg, tmp_path))
    trajs = [t for t, _ in read_trajectories(tmp_path / "trajectories.jsonl")]
    assert summary["trajectories"] == 4 and len(trajs) == 4
    for t in trajs:
        assert t.termination == "interaction_done" and not t.errors and len(t.turns) == 1
        text = t.messages[-1]["content"]
        expected = (t.info["ground_truth"] in text) + 0.5 * (len(text) < 40)
        assert t.reward_parts["interaction"] == expected == t.reward
