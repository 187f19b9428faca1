"""The agent loop: real SmolLM2 rollouts with tools and simulated users, and its limits, exactly.

Real-model scenarios come from conftest's `real_rollouts` (run once, concurrently); exact limit arithmetic
uses the scripted engine, which answers with fixed texts on the real tokenizer.
"""

import asyncio
import copy
import json

import pytest

from turnrl.chat.parsers import HermesParser
from turnrl.chat.templates import ChatTemplate
from turnrl.config.schema import RolloutConfig, ToolSpec
from turnrl.data import Task, task_from_row
from turnrl.engines.base import Sampling
from turnrl.env.builtin.calculator import evaluate, format_number
from turnrl.ledger import Source
from turnrl.rollout.factory import build_environment
from turnrl.rollout.loop import AgentLoop, Limits, request_seed
from turnrl.rollout.scheduler import run_batch


def prompt_length(traj):
    seg = traj.segments[0]
    return next((i for i, s in enumerate(seg.sources) if s != Source.PROMPT), len(seg))


def check_ledger(traj, template):
    """Invariants, parity, and the ledger's text against a fresh render of the messages."""
    traj.check()
    assert traj.parity in ("exact", "token_drift"), traj.metrics.get("parity_detail")
    generation = traj.messages[-1]["role"] != "assistant"
    assert template.decode(traj.segment.token_ids) == template.render(traj.messages, None, generation)
    for turn in traj.turns:
        seg = traj.segments[turn.segment]
        assert all(lp <= 0.0 for lp in seg.logprobs[turn.start:turn.end])
        assert turn.finish_reason in ("stop", "length")


def check_requests(traj, records, loop):
    """Each turn asked for min(per-turn max, budget left, context left) tokens with its own seed, and got
    no more tokens than that."""
    seg, prompt, limits = traj.segments[0], prompt_length(traj), loop.limits
    for turn in traj.turns:
        seed = request_seed(loop.seed, traj.group_id, traj.sample_index, turn.index)
        sampling, completion = records[tuple(seg.token_ids[:turn.start]), seed]
        budget = limits.max_response_tokens - (turn.start - prompt)
        context = limits.max_context_tokens - loop.closing - turn.start
        assert sampling.max_tokens == min(loop.sampling.max_tokens, budget, context)
        assert turn.end - turn.start == len(completion.token_ids) <= sampling.max_tokens
        assert sampling.stop_token_ids == (2,)


# -- real model ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_calculator_rollouts_call_the_real_tool(real_rollouts, smol_template):
    loop, trajs = real_rollouts["calculator"]
    assert len(trajs) == 6 and [(t.group_id, t.sample_index) for t in trajs][:2] == [
        ("calculator-0-0", 0), ("calculator-0-0", 1)]
    calls = [(c, r) for t in trajs for turn in t.turns for c, r in zip(turn.tool_calls, turn.tool_results)]
    assert calls, [t.turns[0].text for t in trajs]
    for call, result in calls:
        assert result.call_id == call.id and result.seconds >= 0
        if (call.error is None and call.name == "calculator" and set(call.arguments) == {"expression"}
                and isinstance(call.arguments["expression"], str)):
            try:
                expected = format_number(evaluate(str(call.arguments["expression"])))
            except ValueError as exc:
                expected = f"Error: {exc}"
            assert result.error is None and result.text == expected
        else:
            assert result.error and result.blame == "policy"
    for traj in trajs:
        check_ledger(traj, smol_template)
        check_requests(traj, real_rollouts["records"], loop)
        assert traj.termination in ("eos", "max_assistant_turns", "token_budget")
        assert traj.masked == any(e.blame == "environment" for e in traj.errors)
        called = [turn for turn in traj.turns if turn.tool_results]
        if called:
            tool_messages = [m for m in traj.messages if m["role"] == "tool"]
            # the demo's own tool message, plus one per executed call
            assert len(tool_messages) == 1 + sum(len(turn.tool_results) for turn in called)
            assert traj.n_tokens(Source.TOOL) > 0
            assert traj.messages[-1]["role"] == "assistant" and len(traj.turns) == 2
            tool_span = [i for i, s in enumerate(traj.segment.sources) if s == Source.TOOL]
            assert min(tool_span) > traj.turns[0].end - 1 and max(tool_span) < traj.turns[1].start


@pytest.mark.slow
def test_simulated_users_talk_back(real_rollouts, smol_template):
    loop, trajs = real_rollouts["interactive"]
    assert {t.info["data_source"] for t in trajs} == {"feedback_math", "guess_number"}
    for traj in trajs:
        check_ledger(traj, smol_template)
        check_requests(traj, real_rollouts["records"], loop)
        assert traj.termination in ("interaction_done", "max_assistant_turns"), traj.termination
        assert not traj.masked and traj.errors == []
        assert traj.n_tokens(Source.TOOL) == 0 and traj.tools == []
        users = [m for m in traj.messages[2:] if m["role"] == "user"]
        assert len(users) == len(traj.turns) - 1          # a reply after every turn but the last
        assert (traj.n_tokens(Source.USER) > 0) == bool(users)
        for turn in traj.turns:
            assert turn.user_reply is not None            # the user judged every answer, the last one too
        if traj.termination == "max_assistant_turns":
            assert len(traj.turns) == 3
        part = traj.reward_parts["interaction"]
        if traj.info["data_source"] == "feedback_math":   # 3 attempts, 3 turns: the user ends it either way
            assert traj.termination == "interaction_done"
            correct = traj.turns[-1].user_reply == "Correct, thank you!"
            assert part == (1.0 if correct else 0.0) and (correct or len(traj.turns) == 3)
        else:
            found = traj.turns[-1].user_reply == "Correct! You found it."
            assert (traj.termination == "interaction_done") == found and (part > 0) == found


@pytest.mark.slow
def test_tight_limits_with_the_real_model(real_rollouts, smol_template):
    loop, trajs = real_rollouts["tight"]
    for traj in trajs:
        check_ledger(traj, smol_template)
        check_requests(traj, real_rollouts["records"], loop)
        assert all(turn.end <= loop.limits.max_context_tokens for turn in traj.turns)
        if traj.group_id.startswith("single"):
            assert len(traj.turns) == 1 and traj.termination in ("eos", "token_budget")
            assert traj.termination == ("eos" if traj.turns[0].finish_reason == "stop" else "token_budget")
            assert traj.tools == [] and not traj.masked
        else:
            assert traj.termination in ("context_limit", "interaction_done"), traj.termination


# -- limits, exactly ----------------------------------------------------------------------------------------
def calc_call(expression="1 + 1"):
    return f"<tool_call>\n{json.dumps({'name': 'calculator', 'arguments': {'expression': expression}})}\n</tool_call>"


def tagged(tag, **fields):
    return Task(uid=tag, messages=[{"role": "user", "content": f"[case:{tag}] go"}], **fields)


def run_one(loop, task, n=1):
    trajs = asyncio.run(run_batch(loop, [task], n=n, concurrency=4))
    return trajs if n > 1 else trajs[0]


def builtin_env():
    return build_environment(RolloutConfig())


def test_max_assistant_turns(scripted, make_loop, smol_template):
    engine = scripted({"loop": [calc_call()]})
    traj = run_one(make_loop(engine, builtin_env(), Limits(max_assistant_turns=3)), tagged("loop", tools=["calculator"]))
    check_ledger(traj, smol_template)
    assert traj.termination == "max_assistant_turns" and len(traj.turns) == 3
    assert [len(t.tool_results) for t in traj.turns] == [1, 1, 0]     # the last turn's call is not run
    assert [t.tool_results[0].text for t in traj.turns[:2]] == ["2", "2"]
    assert [s.seed for _, _, s in engine.requests] == [request_seed(0, "loop", 0, k) for k in range(3)]


@pytest.mark.parametrize("max_user_turns, turns", [(0, 1), (2, 3)])
def test_max_user_turns(scripted, make_loop, max_user_turns, turns):
    engine = scripted({"loop": [calc_call()]})
    limits = Limits(max_assistant_turns=10, max_user_turns=max_user_turns)
    traj = run_one(make_loop(engine, builtin_env(), limits), tagged("loop", tools=["calculator"]))
    assert traj.termination == "max_user_turns" and len(traj.turns) == turns
    assert sum(len(t.tool_results) for t in traj.turns) == max_user_turns


def test_response_token_budget_shrinks_each_turn_and_stops(scripted, make_loop, smol_template):
    wrong = "I am not sure, but after thinking about it for a while I believe that the answer is 3."  # 22 tokens
    engine = scripted({"budget": [wrong]})
    limits = Limits(max_assistant_turns=10, max_user_turns=10, max_response_tokens=60)
    task = tagged("budget", tools=[], interaction={"name": "math_feedback", "ground_truth": "4", "max_attempts": 10})
    traj = run_one(make_loop(engine, builtin_env(), limits, Sampling(max_tokens=32)), task)
    check_ledger(traj, smol_template)
    prompt = prompt_length(traj)
    asked = [s.max_tokens for _, _, s in engine.requests]
    for turn, max_tokens in zip(traj.turns, asked):
        assert max_tokens == min(32, 60 - (turn.start - prompt))
    assert traj.termination == "token_budget" and asked == [32, 11] and len(traj.turns) == 2
    assert traj.turns[-1].finish_reason == "length"
    assert traj.turns[-1].end - prompt == 60       # policy and user tokens after the prompt fill the budget
    assert traj.messages[-1]["role"] == "assistant"


def test_budget_equal_to_the_turn_limit_still_stops(scripted, make_loop):
    """A turn cut at the exact end of the budget ends the trajectory: no user reply past the budget."""
    engine = scripted({"exact": ["one two three four five six seven eight nine ten eleven twelve"]})
    task = tagged("exact", tools=[], interaction={"name": "math_feedback", "ground_truth": "4"})
    limits = Limits(max_response_tokens=8)
    traj = run_one(make_loop(engine, builtin_env(), limits, Sampling(max_tokens=8)), task)
    assert traj.termination == "token_budget" and len(traj.turns) == 1
    assert traj.turns[0].end - prompt_length(traj) == 8 and traj.messages[-1]["role"] == "assistant"


def test_context_limit(scripted, make_loop):
    engine = scripted({"ctx": ["word " * 50]})
    task = tagged("ctx", tools=[])
    probe = run_one(make_loop(scripted({"ctx": ["hi"]}), builtin_env()), task)
    limits = Limits(max_context_tokens=prompt_length(probe) + 10)
    traj = run_one(make_loop(engine, builtin_env(), limits), task)
    closing = 2   # ChatML's '<|im_end|>\n' that closes the cut turn
    assert traj.termination == "context_limit" and engine.requests[0][2].max_tokens == 10 - closing
    assert traj.turns[-1].end == limits.max_context_tokens - closing == len(traj.segment) - closing


@pytest.mark.parametrize("text, max_tokens, termination", [
    ("Blue.", 16, "eos"),
    ("A long answer " * 10, 16, "token_budget"),
])
def test_single_turn_rows(scripted, make_loop, smol_template, text, max_tokens, termination):
    engine = scripted({"single": [text]})
    row = task_from_row({"messages": [{"role": "user", "content": "[case:single] Name a colour."}]}, 0, "x:1")
    assert row.tools is None                       # no tools named: the configured ones, here none
    traj = run_one(make_loop(engine, builtin_env(), sampling=Sampling(max_tokens=max_tokens)), row)
    check_ledger(traj, smol_template)
    assert traj.termination == termination and len(traj.turns) == 1 and traj.tools == []
    assert not traj.masked and traj.errors == []
    assert traj.turns[0].end - traj.turns[0].start == min(len(smol_template.encode(text)) + 1, max_tokens)


def test_rows_without_tools_get_only_the_configured_tools(scripted, make_loop):
    cfg = RolloutConfig()
    cfg.tools = []
    env = build_environment(cfg)
    assert env.default_tools == [] and "calculator" in env.tool_factories   # built-ins only by name
    cfg.tools = [ToolSpec(class_name="calculator")]
    configured = build_environment(cfg)
    engine = scripted({"calc": [calc_call("3 * 3"), "#### 9"]})
    traj = run_one(make_loop(engine, configured), tagged("calc"))
    assert [t["function"]["name"] for t in traj.tools] == ["calculator"]
    assert traj.turns[0].tool_results[0].text == "9" and traj.termination == "eos"


def test_unknown_tool_or_interaction_names_in_a_row_are_recorded(scripted, make_loop):
    engine = scripted({"bad": ["x"]})
    traj = run_one(make_loop(engine, builtin_env()), tagged("bad", tools=["telescope"]))
    assert traj.termination == "error" and traj.masked and traj.errors[0].kind == "internal"
    assert "unknown tool(s) ['telescope']" in traj.errors[0].message
    traj = run_one(make_loop(engine, builtin_env()), tagged("bad", tools=[], interaction={"name": "oracle"}))
    assert traj.termination == "error" and "unknown interaction 'oracle'" in traj.errors[0].message


@pytest.mark.parametrize("max_turns, answers, termination, reward", [
    (1, ["7"], "interaction_done", 1.0),               # a single-turn interaction still judges its answer
    (2, ["5", "7"], "interaction_done", 1.0),          # the right answer on the last allowed turn counts
    (2, ["5", "6"], "max_assistant_turns", 0.0),
])
def test_the_interaction_judges_the_last_answer(scripted, make_loop, max_turns, answers, termination, reward):
    engine = scripted({"judge": answers})
    task = tagged("judge", tools=[], interaction={"name": "math_feedback", "ground_truth": "7"})
    traj = run_one(make_loop(engine, builtin_env(), Limits(max_assistant_turns=max_turns)), task)
    assert traj.termination == termination and len(traj.turns) == len(answers)
    assert traj.reward_parts["interaction"] == reward
    assert all(turn.user_reply for turn in traj.turns)
    assert traj.messages[-1] == {"role": "assistant", "content": answers[-1]}   # the last reply is not appended
    assert [m["role"] for m in traj.messages].count("user") == len(answers)


def test_samples_of_a_task_get_distinct_seeds_and_are_ordered(scripted, make_loop):
    engine = scripted({"seeds": ["ok"]})
    trajs = run_one(make_loop(engine, builtin_env(), seed=7), tagged("seeds", tools=[]), n=3)
    assert [t.sample_index for t in trajs] == [0, 1, 2]
    seeds = sorted(s.seed for _, _, s in engine.requests)
    assert seeds == sorted(request_seed(7, "seeds", k, 0) for k in range(3)) and len(set(seeds)) == 3


# ChatML that drops reasoning from assistant messages: not append-only once the policy has thought aloud.
STRIPS_THINKING = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' %}{{ m.content.split('</think>')[-1] }}{%- else %}{{ m.content }}{%- endif %}"
    "{{ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def test_split_segments_do_not_count_the_conversation_twice_against_the_budget(smol_tokenizer, scripted):
    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.chat_template = STRIPS_THINKING
    template = ChatTemplate(tokenizer)
    engine = scripted({"split": ["<think>Maybe five.</think>5", "7"]}, template=template)
    task = tagged("split", tools=[], interaction={"name": "math_feedback", "ground_truth": "7"})
    limits = Limits(max_assistant_turns=3, max_response_tokens=60)
    loop = AgentLoop(engine, template, HermesParser(), builtin_env(), limits, Sampling(max_tokens=32),
                     on_mismatch="split")
    traj = run_one(loop, task)
    assert len(traj.segments) == 2 and traj.parity == "split"
    assert traj.termination == "interaction_done" and len(traj.turns) == 2
    prompt = prompt_length(traj)
    second = engine.requests[1]
    assert second[1] == traj.turns[1].start       # the split segment: the whole conversation so far
    assert second[2].max_tokens == min(32, 60 - (second[1] - prompt))
    traj.check()
