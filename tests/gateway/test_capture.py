"""Session capture: requests placed in the ledger by chat-template deltas, replies kept as sampled.

A scripted engine on the real SmolLM2 tokenizer gives known completions, so each test can check that the
ledger's policy tokens are exactly the engine's, whatever the agent sends back."""

import asyncio
import json

import pytest

from turnrl.gateway.requests import APIError, parse_chat
from turnrl.ledger import Source
from tests.gateway.conftest import CALC

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call>'
USER = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 17*23?"}]


def chat(gateway, session, messages, **kw):
    body = {"model": "smol", "messages": messages, "tools": [CALC], **kw}
    return asyncio.run(gateway.chat(parse_chat(body), session))


def policy_runs(traj):
    """The policy tokens of each segment, as one list per segment."""
    return [[t for t, s in zip(seg.token_ids, seg.sources) if s == Source.POLICY] for seg in traj.segments]


def sampled(template, text):
    return template.encode(text) + [template.stop_token_ids[0]]


def test_reserialized_tool_call_json_keeps_the_sampled_tokens(scripted_gateway, smol_template):
    gateway, engine = scripted_gateway([CALL, "#### 391"])
    session = gateway.open_session("row-1")
    first = chat(gateway, session, USER).replies[0]
    assert first.openai_finish == "tool_calls" and first.content is None
    assert first.message()["tool_calls"][0]["function"] == {"name": "calculator",
                                                            "arguments": '{"expression": "17*23"}'}
    # The agent sends the call back re-serialized: other whitespace, another id, no content.
    echoed = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_other", "type": "function", "function": {"name": "calculator", "arguments": '{ "expression" :"17*23" }'}}]}
    tool = {"role": "tool", "tool_call_id": "call_other", "content": "391"}
    second = chat(gateway, session, USER + [echoed, tool]).replies[0]
    assert second.openai_finish == "stop" and second.content == "#### 391"
    traj = gateway.close_session(session.id)
    assert len(traj.segments) == 1 and traj.parity == "exact"
    assert policy_runs(traj) == [sampled(smol_template, CALL) + sampled(smol_template, "#### 391")]
    seg = traj.segment
    assert [lp for lp, s in zip(seg.logprobs, seg.sources) if s == Source.POLICY] == \
        [-0.01] * len(sampled(smol_template, CALL)) + [-0.02] * len(sampled(smol_template, "#### 391"))
    # the second call's prompt was the ledger itself: what the policy saw is what is trained on
    assert engine.prompts[1] == seg.token_ids[:len(engine.prompts[1])]
    assert traj.turns[0].tool_results[0].text == "391" and traj.turns[0].tool_results[0].name == "calculator"
    assert traj.metrics["gateway/calls"] == 2 and traj.metrics["gateway/breaks"] == 0
    assert traj.info["session"] == session.id and traj.group_id == "row-1"


def test_rewritten_reply_is_a_break_with_its_reason(scripted_gateway, smol_template):
    gateway, _ = scripted_gateway(["The answer is 391.", "ok"], on_mismatch="split")
    session = gateway.open_session()
    chat(gateway, session, USER)
    rewritten = USER + [{"role": "assistant", "content": "391"}, {"role": "user", "content": "Thanks"}]
    chat(gateway, session, rewritten)
    traj = gateway.close_session(session.id)
    assert traj.parity == "split" and len(traj.segments) == 2 and not traj.masked
    assert "differs from the reply the gateway sampled" in traj.metrics["breaks"][0]
    # both replies are trained, each once, in its own segment
    assert policy_runs(traj) == [sampled(smol_template, "The answer is 391."), sampled(smol_template, "ok")]


def test_break_under_on_mismatch_error_masks_the_trajectory(scripted_gateway):
    gateway, _ = scripted_gateway(["a", "b"], on_mismatch="error")
    session = gateway.open_session()
    chat(gateway, session, USER)
    chat(gateway, session, USER + [{"role": "user", "content": "again"}])   # the reply was dropped
    traj = gateway.close_session(session.id)
    assert traj.masked and traj.errors[-1].kind == "chat"
    assert "the reply was dropped" in traj.metrics["breaks"][0]


def test_changed_history_prefix_is_a_break(scripted_gateway):
    gateway, _ = scripted_gateway(["a", "b", "c"])
    session = gateway.open_session()
    chat(gateway, session, USER)
    chat(gateway, session, [USER[0], {"role": "user", "content": "What is 2+2?"}])     # shares the system prompt only
    chat(gateway, session, [{"role": "user", "content": "a sub-agent's own task"}])    # shares nothing: a new conversation
    traj = gateway.close_session(session.id)
    assert traj.metrics["gateway/breaks"] == 1 and "departs from the first call's prompt" in traj.metrics["breaks"][0]
    assert traj.metrics["gateway/conversations"] == 2 and len(traj.segments) == 3


def test_concurrent_identical_calls_become_sibling_branches(scripted_gateway, smol_template):
    gateway, engine = scripted_gateway(["one", "two"], delay=0.05)
    session = gateway.open_session()

    async def both():
        body = parse_chat({"model": "smol", "messages": USER})
        return await asyncio.gather(gateway.chat(body, session), gateway.chat(body, session))

    asyncio.run(both())
    traj = gateway.close_session(session.id)
    assert traj.metrics["gateway/forks"] == 1 and traj.metrics["gateway/breaks"] == 0
    assert sorted(policy_runs(traj)) == sorted([sampled(smol_template, "one"), sampled(smol_template, "two")])
    assert engine.prompts[0] == engine.prompts[1]
    assert traj.parity == "exact"


def test_fan_out_after_a_reply_trains_the_shared_reply_once(scripted_gateway, smol_template):
    gateway, _ = scripted_gateway([CALL, "x", "y"], delay=0.02)
    session = gateway.open_session()
    reply = chat(gateway, session, USER).replies[0].message()

    async def fan_out():
        a = parse_chat({"model": "smol", "messages": USER + [reply, {"role": "tool", "content": "391"}], "tools": [CALC]})
        b = parse_chat({"model": "smol", "messages": USER + [reply, {"role": "tool", "content": "392"}], "tools": [CALC]})
        return await asyncio.gather(gateway.chat(a, session), gateway.chat(b, session))

    asyncio.run(fan_out())
    traj = gateway.close_session(session.id)
    runs = policy_runs(traj)
    assert len(runs) == 2 and traj.metrics["gateway/forks"] == 1
    call = sampled(smol_template, CALL)
    assert sorted(runs) == sorted([call + sampled(smol_template, "x"), sampled(smol_template, "y")])
    fork = traj.segments[1]
    assert smol_template.decode(fork.token_ids).count("17*23") >= 2   # the call is there, as context
    traj.check()


def test_n_choices_are_siblings_and_the_chosen_one_is_extended(scripted_gateway, smol_template):
    gateway, _ = scripted_gateway(["A", "B", "C", "next"])
    session = gateway.open_session()
    answer = chat(gateway, session, USER, n=3)
    assert [r.content for r in answer.replies] == ["A", "B", "C"]
    chosen = answer.replies[2].message()
    chat(gateway, session, USER + [chosen, {"role": "user", "content": "go on"}])
    traj = gateway.close_session(session.id)
    runs = policy_runs(traj)
    assert sampled(smol_template, "C") + sampled(smol_template, "next") in runs
    assert sampled(smol_template, "A") in runs and sampled(smol_template, "B") in runs
    assert traj.metrics["gateway/breaks"] == 0


def test_failed_calls_leave_the_session_unchanged(scripted_gateway):
    gateway, _ = scripted_gateway(["fine"], max_context=60)
    session = gateway.open_session()
    with pytest.raises(APIError) as err:
        chat(gateway, session, USER)   # the tool prompt alone is longer than 60 tokens
    assert err.value.status == 400 and "maximum context length is 60 tokens" in err.value.message
    assert session.branches == [] and session.calls == 0
    gateway2, _ = scripted_gateway(["fine", "again"])
    s2 = gateway2.open_session()
    first = chat(gateway2, s2, [{"role": "user", "content": "hi"}]).replies[0].message()
    before = list(s2.branches[0].chat.traj.segment.token_ids)
    gateway2.defaults = type(gateway2.defaults)(max_context=len(before) + 3)
    with pytest.raises(APIError):
        chat(gateway2, s2, [{"role": "user", "content": "hi"}, first, {"role": "user", "content": "x " * 50}])
    assert s2.branches[0].chat.traj.segment.token_ids == before and len(s2.branches) == 1


def test_malformed_tool_call_stays_in_the_content_and_counts(scripted_gateway):
    bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": }\n</tool_call>'
    gateway, _ = scripted_gateway([bad])
    session = gateway.open_session()
    reply = chat(gateway, session, USER).replies[0]
    assert reply.openai_finish == "stop" and reply.content == bad and not reply.calls
    traj = gateway.close_session(session.id)
    assert [e.kind for e in traj.errors] == ["tool_parse"] and not traj.masked   # the policy's mistake: trained


def test_stop_strings_cut_content_and_ledger_at_the_same_token(scripted_gateway, smol_template):
    gateway, _ = scripted_gateway(["alpha beta STOP gamma delta"])
    session = gateway.open_session()
    reply = chat(gateway, session, USER, stop=["STOP"]).replies[0]
    assert reply.content == "alpha beta " and reply.finish_reason == "stop"
    assert smol_template.decode(reply.token_ids).endswith("STOP")
    traj = gateway.close_session(session.id)
    assert policy_runs(traj) == [reply.token_ids]


def test_pinned_sampling_keeps_the_config_temperature(scripted_gateway):
    gateway, engine = scripted_gateway(["x"], temperature=0.8)
    gateway.pin_sampling = True
    seen = []
    inner = engine.generate

    async def spy(prompt, sampling):
        seen.append(sampling)
        return await inner(prompt, sampling)
    engine.generate = spy
    chat(gateway, gateway.open_session(), USER, temperature=0.0, seed=5)
    assert seen[0].temperature == 0.8 and seen[0].seed == 5 and gateway.stats["sampling_overridden"] == 1


def test_session_ids_are_unguessable_and_unknown_ones_404(scripted_gateway):
    gateway, _ = scripted_gateway(["x"])
    ids = {gateway.open_session().id for _ in range(50)}
    assert len(ids) == 50 and all(len(i) >= 32 for i in ids)
    with pytest.raises(APIError) as err:
        gateway.session("nope")
    assert err.value.status == 404 and err.value.code == "session_not_found"
    assert json.dumps(err.value.body())


# -- tool_choice required / named: a forced call opening ---------------------------------------------
REQUIRED_OPENING = '<tool_call>\n{"name": "'
NAMED = {"type": "function", "function": {"name": "calculator"}}


def sources_around(traj, turn, before):
    """(ids, sources, loss mask) of the `before` tokens ahead of the turn's span and of the span itself."""
    seg = traj.segments[turn.segment]
    ahead = range(turn.start - before, turn.start)
    span = range(turn.start, turn.end)
    return ([seg.token_ids[i] for i in ahead], [seg.sources[i] for i in ahead], [seg.loss_mask[i] for i in ahead],
            [seg.sources[i] for i in span], [seg.loss_mask[i] for i in span])


def test_required_tool_choice_forces_the_opening_as_template_tokens_and_the_echo_matches(scripted_gateway,
                                                                                          smol_template):
    rest = 'calculator", "arguments": {"expression": "17*23"}}\n</tool_call>'   # what the policy samples
    gateway, engine = scripted_gateway([rest, "#### 391"])
    session = gateway.open_session()
    first = chat(gateway, session, USER, tool_choice="required").replies[0]
    opening = smol_template.encode(REQUIRED_OPENING)
    assert engine.prompts[0][-len(opening):] == opening        # the engine continued from the opening
    assert first.openai_finish == "tool_calls" and first.content is None
    assert first.message()["tool_calls"][0]["function"] == {"name": "calculator",
                                                            "arguments": '{"expression": "17*23"}'}
    assert first.text == CALL and first.token_ids == sampled(smol_template, rest)   # sampled ids only
    # The agent echoes the call (the forced text and the sampled text, as one message) and the result.
    echoed = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_x", "type": "function",
         "function": {"name": "calculator", "arguments": '{"expression": "17*23"}'}}]}
    second = chat(gateway, session, USER + [echoed, {"role": "tool", "tool_call_id": "call_x", "content": "391"}])
    assert second.replies[0].content == "#### 391"
    assert engine.prompts[1][-len(opening):] != opening        # tool_choice auto: nothing forced
    traj = gateway.close_session(session.id)
    traj.check()
    assert len(traj.segments) == 1 and traj.parity == "exact" and traj.metrics["gateway/breaks"] == 0
    ids, sources, mask, span_sources, span_mask = sources_around(traj, traj.turns[0], len(opening))
    assert ids == opening and set(sources) == {Source.TEMPLATE} and set(mask) == {0}
    assert set(span_sources) == {Source.POLICY} and set(span_mask) == {1}
    assert policy_runs(traj) == [sampled(smol_template, rest) + sampled(smol_template, "#### 391")]
    assert traj.messages[-3]["content"] == CALL   # the trajectory's message holds the whole call
    assert traj.turns[0].tool_calls[0].name == "calculator" and traj.turns[0].text == CALL


def test_named_tool_choice_forces_that_function_for_every_choice(scripted_gateway, smol_template):
    rest = ' {"expression": "%d"}}\n</tool_call>'
    gateway, engine = scripted_gateway([rest % 1, rest % 2, rest % 3, "plain"])
    session = gateway.open_session()
    answer = chat(gateway, session, USER, tool_choice=NAMED, n=3)
    opening = smol_template.encode('<tool_call>\n{"name": "calculator", "arguments":')
    assert all(p[-len(opening):] == opening for p in engine.prompts)
    assert [r.calls[0].arguments for r in answer.replies] == [{"expression": str(k)} for k in (1, 2, 3)]
    assert {r.openai_finish for r in answer.replies} == {"tool_calls"}
    # The same prompt again with tool_choice auto: a sibling from the prompt, without the opening.
    again = chat(gateway, session, USER).replies[0]
    assert again.content == "plain" and engine.prompts[3] == engine.prompts[0][:-len(opening)]
    traj = gateway.close_session(session.id)
    traj.check()
    assert traj.parity == "exact" and len(traj.segments) == 4
    for turn in traj.turns[:3]:
        ids, sources, mask, span_sources, span_mask = sources_around(traj, turn, len(opening))
        assert ids == opening and set(sources) == {Source.TEMPLATE} and set(mask) == {0} and set(span_mask) == {1}


def test_unforceable_tool_choice_is_a_400_naming_the_parser_and_changes_nothing(scripted_gateway, smol_template):
    from turnrl.chat.parsers import get_parser
    gateway, engine = scripted_gateway(["x"])
    gateway.parser = get_parser("mistral")
    session = gateway.open_session()
    with pytest.raises(APIError) as err:
        chat(gateway, session, USER, tool_choice=NAMED)
    assert err.value.status == 400 and err.value.param == "tool_choice"
    assert "'mistral' tool parser" in err.value.message and "'calculator'" in err.value.message
    assert session.branches == [] and engine.prompts == []
    chat(gateway, session, USER, tool_choice="required")   # [TOOL_CALLS] opens a call in every Mistral version
    assert smol_template.decode(engine.prompts[0]).endswith("assistant\n[TOOL_CALLS]") and session.calls == 1


def test_tool_choice_required_without_tools_or_none_forces_nothing(scripted_gateway, smol_template):
    gateway, engine = scripted_gateway(["x"])
    session = gateway.open_session()
    asyncio.run(gateway.chat(parse_chat({"model": "smol", "messages": USER, "tool_choice": "required"}), session))
    chat(gateway, session, USER, tool_choice="none")
    assert all(smol_template.decode(p).endswith("<|im_start|>assistant\n") for p in engine.prompts)


def test_forcing_is_a_400_when_the_generation_prompt_opens_thinking(smol_tokenizer):
    """Qwen3.5's generation prompt ends in `<think>`: a forced call would be reasoning, which parsers skip."""
    from tests.chat.families import FAMILIES, family_tokenizer
    from tests.gateway.conftest import ScriptedEngine
    from turnrl.chat.parsers import get_parser
    from turnrl.chat.templates import ChatTemplate
    from turnrl.gateway.service import Gateway
    template = ChatTemplate(family_tokenizer(smol_tokenizer, FAMILIES["qwen3_5"]))
    assert template.prompt_opens_thinking
    engine = ScriptedEngine(template, ["x"])
    gateway = Gateway(engine, template, get_parser("qwen3_coder"), ["smol"])
    with pytest.raises(APIError) as err:
        chat(gateway, gateway.open_session(), USER, tool_choice="required")
    assert err.value.status == 400 and "opens <think>" in err.value.message and engine.prompts == []
