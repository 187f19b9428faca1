"""The context limit holds against the environment's output too (issue 17 item 2, issue 16 item 2).

A tool result or a simulated user's reply that does not fit `max_context_tokens` / `max_response_tokens` is
cut with the tool-output marker, or ends the trajectory with `context_limit` / `token_budget`: no trajectory
(so no training row) is ever longer than the limit. A huge tool output is cut before it is tokenized, and the
hf engine never generates past `engine.max_model_len`.
"""

import asyncio
import json

import pytest

from turnrl.data import Task
from turnrl.engines.base import Sampling
from turnrl.ledger import Source
from turnrl.rollout.loop import Environment, Limits, truncate_tokens
from turnrl.rollout.scheduler import run_batch

NO_ARGS = {"type": "object", "properties": {}}


def tool(name, text):
    schema = {"type": "function", "function": {"name": name, "description": name, "parameters": NO_ARGS}}
    return type(name, (), {"name": name, "schema": schema, "execute": lambda self, args: text})


def call(name):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': {}})}\n</tool_call>"


class Talker:
    """A simulated user whose every reply is `text`."""

    def __init__(self, text):
        self.text = text

    def start(self, **kwargs):
        pass

    def respond(self, messages):
        return self.text

    def finish(self):
        return 0.0


LONG = "the quick brown fox jumps over the lazy dog " * 2000         # ~18k tokens


def rollout(fault_loop, cases, limits, max_tool_response_tokens=100_000):
    tools = {"long": tool("long", LONG), "short": tool("short", "42")}
    users = {"talker": lambda: Talker(LONG), "brief": lambda: Talker("Try again.")}
    env = Environment(tools, users, tool_timeout_s=30.0, max_tool_response_tokens=max_tool_response_tokens)
    tasks = [Task(uid=tag, messages=[{"role": "user", "content": f"[case:{tag}] Go."}], tools=tools_,
                  interaction=interaction) for tag, (tools_, interaction, _) in cases.items()]
    loop = fault_loop({tag: script for tag, (_, _, script) in cases.items()}, env, limits)
    return {t.group_id: t for t in asyncio.run(run_batch(loop, tasks, n=1, concurrency=8))}


CASES = {
    "long_tool": (["long"], None, [call("long"), "Done."]),
    "long_user": ([], {"name": "talker"}, ["My answer."]),
    "tools_then_long": (["short", "long"], None, [call("short"), call("short"), call("long"), "Done."]),
}


@pytest.mark.parametrize("limits", [Limits(max_assistant_turns=4, max_user_turns=4, max_context_tokens=512,
                                           max_response_tokens=100_000),
                                    Limits(max_assistant_turns=4, max_user_turns=4, max_context_tokens=100_000,
                                           max_response_tokens=300)],
                         ids=["context", "response_budget"])
def test_no_environment_turn_overshoots_the_limits(fault_loop, limits):
    trajs = rollout(fault_loop, CASES, limits)
    for tag, traj in trajs.items():
        traj.check()
        assert not traj.masked, (tag, traj.errors)
        prompt = traj.turns[0].start
        for seg in traj.segments:
            assert len(seg.token_ids) <= limits.max_context_tokens, (tag, len(seg.token_ids))
        closing = 2   # the template's '<|im_end|>\n' closing the last turn is not counted as a response token
        assert len(traj.segment.token_ids) - prompt <= limits.max_response_tokens + closing, tag
        assert traj.termination in ("eos", "context_limit", "token_budget"), (tag, traj.termination)
        env_tokens = traj.n_tokens(Source.TOOL) + traj.n_tokens(Source.USER)
        if env_tokens:   # what was shown was cut with the marker
            text = json.dumps(traj.messages[2:])
            assert "tokens truncated]..." in text, tag


def test_a_long_tool_result_is_cut_and_the_policy_answers_it(fault_loop):
    limits = Limits(max_assistant_turns=4, max_context_tokens=600, max_response_tokens=100_000)
    traj = rollout(fault_loop, {"long_tool": CASES["long_tool"]}, limits)["long_tool"]
    assert len(traj.turns) == 2 and len(traj.segment.token_ids) <= 600
    result = traj.turns[0].tool_results[0]
    assert result.truncated and "tokens truncated]..." in result.text     # the record shows what the model saw
    assert traj.termination in ("eos", "context_limit")


def test_a_turn_that_cannot_fit_at_all_ends_the_trajectory_with_context_limit(fault_loop):
    probe = rollout(fault_loop, {"short": (["long"], None, ["Done."])}, Limits())["short"]
    prompt = probe.turns[0].start
    first = len(fault_loop({}, None).template.encode(call("long"))) + 1
    limits = Limits(max_context_tokens=prompt + first + 12, max_response_tokens=100_000)   # no room for a result
    traj = rollout(fault_loop, {"long_tool": CASES["long_tool"]}, limits)["long_tool"]
    assert traj.termination == "context_limit" and len(traj.turns) == 1
    assert len(traj.segment.token_ids) <= limits.max_context_tokens and traj.n_tokens(Source.TOOL) == 0


class CountingTemplate:
    """The real template, recording the length of every text it tokenizes."""

    def __init__(self, template):
        self.template, self.lengths = template, []

    def encode(self, text):
        self.lengths.append(len(text))
        return self.template.encode(text)

    def decode(self, ids):
        return self.template.decode(ids)


@pytest.mark.parametrize("side", ["head", "tail", "middle"])
def test_a_huge_tool_output_is_cut_before_it_is_tokenized(smol_template, side):
    counting = CountingTemplate(smol_template)
    huge = "0123456789abcdef " * 600_000                       # 10 MB
    out, truncated = truncate_tokens(counting, huge, 256, side)
    assert truncated and max(counting.lengths) < 100_000      # never the 10 MB
    assert len(smol_template.encode(out)) <= 256 + 2
    assert "tokens truncated]..." in out
    if side != "head":
        assert out.startswith("0123456789abcdef")
    if side != "tail":
        assert out.rstrip().endswith("abcdef")


def test_the_hf_engine_honours_max_model_len(smollm2_dir, smol_template, torch_threads):
    from turnrl.config.schema import EngineConfig
    from turnrl.rollout.factory import build_engine, build_loop
    from turnrl.config.schema import RolloutConfig
    from turnrl.rollout.factory import build_environment

    with torch_threads(1):
        engine = build_engine(EngineConfig(kind="hf", max_model_len=48, dtype="float32", device="cpu"), smollm2_dir)
        try:
            prompt = smol_template.encode("Count from one to one hundred in words, please: one, two,")
            completion = asyncio.run(engine.generate(prompt, Sampling(max_tokens=200, temperature=0.0)))
            assert len(prompt) + len(completion.token_ids) <= 48 and completion.finish_reason == "length"
            cfg = RolloutConfig(max_assistant_turns=1, max_context_tokens=4096)
            loop = build_loop(cfg, engine, smol_template, build_environment(cfg), seed=0)
            assert loop.limits.max_context_tokens == 48       # the loop stops at the engine's limit
        finally:
            asyncio.run(engine.close())
