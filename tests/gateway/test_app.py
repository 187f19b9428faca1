"""The gateway over HTTP, driven by the real `openai` SDK: SmolLM2 on the hf engine, and a scripted engine
where a test needs a tool call (SmolLM2 rarely writes one on its own)."""

import asyncio
import time

import httpx
import openai
import pytest

from turnrl.chat.parsers import get_parser
from turnrl.ledger import Source
from tests.gateway.conftest import CALC, decoding_settled, served

USER = [{"role": "user", "content": "Name a colour."}]


def run(coro):
    return asyncio.run(coro)


def test_chat_on_smollm2_is_recorded_token_exact(real_gateway, smol_template):
    gateway = real_gateway()

    async def go():
        async with served(gateway) as url:
            session = gateway.open_session("row")
            client = openai.AsyncOpenAI(base_url=f"{url}/sessions/{session.id}/v1", api_key="unused")
            r1 = await client.chat.completions.create(model="smollm2", messages=USER, temperature=0.7, seed=3,
                                                      max_tokens=12, logprobs=True)
            msgs = USER + [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Another."}]
            r2 = await client.chat.completions.create(model="smollm2", messages=msgs, max_completion_tokens=12, seed=4)
            return session, r1, r2

    session, r1, r2 = run(go())
    c1 = r1.choices[0]
    assert c1.finish_reason in ("stop", "length") and r1.usage.completion_tokens == len(c1.logprobs.content)
    assert all(t.logprob <= 0 for t in c1.logprobs.content)
    traj = gateway.close_session(session.id)
    assert traj.parity in ("exact", "token_drift") and len(traj.segments) == 1
    seg = traj.segment
    policy_lp = [lp for lp, s in zip(seg.logprobs, seg.sources) if s == Source.POLICY]
    assert policy_lp[:len(c1.logprobs.content)] == [t.logprob for t in c1.logprobs.content]
    assert len(traj.turns) == 2 and traj.messages[-1]["role"] == "assistant"
    assert r2.usage.prompt_tokens == len(seg) - r2.usage.completion_tokens - (1 if traj.turns[-1].finish_reason == "stop" else 0) \
        or r2.usage.prompt_tokens < len(seg)


def test_seed_makes_sampling_repeatable_and_n_gives_choices(real_gateway):
    gateway = real_gateway()

    async def go():
        async with served(gateway) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
            a = await client.chat.completions.create(model="smollm2", messages=USER, temperature=1.0, seed=11, max_tokens=8)
            b = await client.chat.completions.create(model="smollm2", messages=USER, temperature=1.0, seed=11, max_tokens=8)
            c = await client.chat.completions.create(model="smollm2", messages=USER, temperature=1.0, seed=11, max_tokens=8, n=3)
            return a, b, c

    a, b, c = run(go())
    assert a.choices[0].message.content == b.choices[0].message.content
    assert len(c.choices) == 3 and [ch.index for ch in c.choices] == [0, 1, 2]
    assert c.choices[0].message.content == a.choices[0].message.content   # choice i samples with seed + i


def test_tool_calls_streaming_models_and_completions(scripted_gateway):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    gateway, _ = scripted_gateway([call, call, "four", "plain text"])

    async def go():
        async with served(gateway) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
            models = await client.models.list()
            full = await client.chat.completions.create(model="smol", messages=USER, tools=[CALC], tool_choice="auto")
            stream = await client.chat.completions.create(model="smol", messages=USER, tools=[CALC], stream=True,
                                                          stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            none = await client.chat.completions.create(model="smol", messages=USER, tools=[CALC], tool_choice="none")
            text = await client.completions.create(model="smol", prompt="Once upon a time", max_tokens=5)
            return models, full, chunks, none, text

    models, full, chunks, none, text = run(go())
    assert [m.id for m in models.data] == ["smol"]
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "calculator"
    assert choice.message.tool_calls[0].function.arguments == '{"expression": "2+2"}'
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "calculator" and calls[0].id.startswith("call_")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens > 0
    assert none.choices[0].message.content == "four" and none.choices[0].finish_reason == "stop"
    assert text.choices[0].text and text.object == "text_completion"


@pytest.mark.parametrize("body, param, status", [
    ({"messages": USER}, "model", 400),
    ({"model": "smol"}, "messages", 400),
    ({"model": "smol", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", 400),
    ({"model": "smol", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type", 400),
    ({"model": "smol", "messages": USER, "temperature": 3}, "temperature", 400),
    ({"model": "smol", "messages": USER, "max_tokens": 0}, "max_tokens", 400),
    ({"model": "smol", "messages": USER, "n": "2"}, "n", 400),
    ({"model": "smol", "messages": USER, "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", 400),
    ({"model": "smol", "messages": USER, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", 400),
    ({"model": "smol", "messages": USER, "frobnicate": 1}, "frobnicate", 400),
    ({"model": "other", "messages": USER}, "model", 404),
])
def test_bad_requests_get_openai_errors_naming_the_field(scripted_gateway, body, param, status):
    gateway, _ = scripted_gateway(["x"])

    async def go():
        async with served(gateway) as url:
            async with httpx.AsyncClient() as http:
                return await http.post(f"{url}/v1/chat/completions", json=body)

    r = run(go())
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_sdk_raises_on_unknown_session_and_long_prompt(scripted_gateway):
    gateway, _ = scripted_gateway(["x"], max_context=40)

    async def go():
        async with served(gateway) as url:
            bad = openai.AsyncOpenAI(base_url=f"{url}/sessions/not-a-session/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.NotFoundError):
                await bad.chat.completions.create(model="smol", messages=USER)
            session = gateway.open_session()
            ok = openai.AsyncOpenAI(base_url=f"{url}/sessions/{session.id}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as err:
                await ok.chat.completions.create(model="smol", messages=[{"role": "user", "content": "word " * 80}])
            async with httpx.AsyncClient() as http:   # garbage JSON in one session breaks nothing
                r = await http.post(f"{url}/sessions/{session.id}/v1/chat/completions", content=b"{not json")
            return err.value, r, session

    err, r, session = run(go())
    assert "maximum context length is 40 tokens" in str(err) and r.status_code == 400
    assert session.calls == 0 and session.branches == []


def test_session_over_http_and_header(scripted_gateway):
    gateway, _ = scripted_gateway(["hello"])
    saved = []

    async def go():
        async with served(gateway, saved.append) as url:
            async with httpx.AsyncClient() as http:
                opened = (await http.post(f"{url}/sessions")).json()
                client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused",
                                            default_headers={"X-TurnRL-Session": opened["id"]})
                await client.chat.completions.create(model="smol", messages=USER)
                info = (await http.get(f"{url}/sessions/{opened['id']}")).json()
                closed = (await http.post(f"{url}/sessions/{opened['id']}/close")).json()
                again = await http.post(f"{url}/sessions/{opened['id']}/close")
            return opened, info, closed, again

    opened, info, closed, again = run(go())
    assert opened["base_url"].endswith(f"/sessions/{opened['id']}/v1") and info["calls"] == 1
    assert closed["parity"] == "exact" and len(saved) == 1 and again.status_code == 404


def test_client_disconnect_aborts_the_engine_request(real_gateway, smol_hf_engine):
    gateway = real_gateway(max_tokens=4000, max_context=8192)
    session = gateway.open_session()

    async def go():
        async with served(gateway) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/sessions/{session.id}/v1", api_key="unused",
                                        max_retries=0, timeout=1.0)
            with pytest.raises(openai.APITimeoutError):
                await client.chat.completions.create(model="smollm2", messages=[
                    {"role": "user", "content": "Write a very long story."}], temperature=1.0, seed=1)
            for _ in range(100):   # the watcher sees the disconnect and cancels the engine request
                if smol_hf_engine.in_flight == 0:
                    break
                await asyncio.sleep(0.05)
            tokens = await decoding_settled(smol_hf_engine)   # the worker drops it at its next step
            return smol_hf_engine.in_flight, tokens

    t0 = time.perf_counter()
    in_flight, tokens = run(go())
    assert in_flight == 0 and time.perf_counter() - t0 < 30
    time.sleep(0.5)
    assert smol_hf_engine.stats["generated_tokens"] == tokens   # nothing decodes for it any more
    assert session.calls == 0 and session.aborted == 1 and gateway.stats["aborted"] == 1


def test_tool_choice_required_and_named_make_smollm2_call(real_gateway, smol_template):
    """SmolLM2 answers in prose with tool_choice auto; required and a named function force the call's opening
    (template tokens, no loss), and it goes on to write the call. The echoed call extends the same branch."""
    gateway = real_gateway(max_tokens=64)
    question = [{"role": "user", "content": "What is 17 times 23?"}]
    named = {"type": "function", "function": {"name": "calculator"}}
    sample = dict(model="smollm2", messages=question, tools=[CALC], temperature=0.3, seed=1)

    async def go():
        async with served(gateway) as url:
            session = gateway.open_session("row")
            client = openai.AsyncOpenAI(base_url=f"{url}/sessions/{session.id}/v1", api_key="unused")
            auto = await client.chat.completions.create(**sample, tool_choice="auto", n=3)
            required = await client.chat.completions.create(**sample, tool_choice="required", n=3)
            chosen = await client.chat.completions.create(**{**sample, "temperature": 0.0}, tool_choice=named)
            call = chosen.choices[0].message
            echo = question + [call.model_dump(exclude_none=True),
                               {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "391"}]
            after = await client.chat.completions.create(model="smollm2", messages=echo, tools=[CALC], max_tokens=12)
            return session, auto, required, chosen, after

    session, auto, required, chosen, after = run(go())
    assert not any(c.message.tool_calls or c.finish_reason == "tool_calls" for c in auto.choices)
    assert [c.finish_reason for c in required.choices] == ["tool_calls"] * 3
    # the call left the content (SmolLM2 often writes a sentence after it, which stays there)
    assert all(c.message.tool_calls and "<tool_call>" not in (c.message.content or "") for c in required.choices)
    assert chosen.choices[0].finish_reason == "tool_calls"
    assert [tc.function.name for tc in chosen.choices[0].message.tool_calls] == ["calculator"]
    assert after.choices[0].finish_reason in ("stop", "length")
    traj = gateway.close_session(session.id)
    traj.check()
    assert traj.metrics["gateway/breaks"] == 0 and traj.parity in ("exact", "token_drift")   # drift: sampled splits
    assert len(traj.segments) == 7 and len(traj.turns) == 8   # 3 auto, 3 required, named + its follow-up
    openings = [smol_template.encode('<tool_call>\n{"name": "'),
                smol_template.encode('<tool_call>\n{"name": "calculator", "arguments":')]
    forced = traj.turns[3:7]   # turns in call order: auto 0-2, required 3-5, named 6, the follow-up 7
    assert forced[3].tool_calls[0].name == "calculator" and not any(t.tool_calls for t in traj.turns[:3])
    for turn, opening in zip(forced, [openings[0]] * 3 + [openings[1]]):
        seg = traj.segments[turn.segment]
        assert seg.token_ids[turn.start - len(opening):turn.start] == opening and turn.text.startswith("<tool_call>")
        ahead = range(turn.start - len(opening), turn.start)
        assert {seg.sources[i] for i in ahead} == {Source.TEMPLATE} and {seg.loss_mask[i] for i in ahead} == {0}
        assert {seg.loss_mask[i] for i in range(turn.start, turn.end)} == {1}
        # the opening is tokenized as a full render would: no drift comes from it
        assert smol_template.encode(smol_template.decode(seg.token_ids[:turn.start])) == seg.token_ids[:turn.start]
    named_seg = traj.segments[forced[-1].segment]
    assert traj.turns[-1].segment == forced[-1].segment   # the echoed call was recognised: same branch
    assert "391" in smol_template.decode(named_seg.token_ids)


def test_forced_call_without_a_session_and_unforceable_tool_choice_over_http(scripted_gateway, smol_template):
    gateway, engine = scripted_gateway(['calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'])
    named = {"type": "function", "function": {"name": "calculator"}}

    async def go():
        async with served(gateway) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            forced = await client.chat.completions.create(model="smol", messages=USER, tools=[CALC],
                                                          tool_choice="required")
            gateway.parser = get_parser("deepseek_v3")
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="smol", messages=USER, tools=[CALC], tool_choice=named)
            return forced, err.value

    forced, err = run(go())
    assert forced.choices[0].finish_reason == "tool_calls"
    assert forced.choices[0].message.tool_calls[0].function.arguments == '{"expression": "2+2"}'
    assert smol_template.decode(engine.prompts[0]).endswith('assistant\n<tool_call>\n{"name": "')
    assert err.status_code == 400 and "'deepseek_v3' tool parser" in err.message and len(engine.prompts) == 1


def test_answers_say_the_gateways_time_and_the_engines(scripted_gateway):
    """`Server-Timing`: the engine's share (a scripted engine that takes 500 ms) and the gateway's own (a few ms,
    bounded well above that so a loaded machine's pauses do not fail it, and below the engine's time)."""
    gateway, _ = scripted_gateway(["Blue."], delay=0.5)

    async def go():
        async with served(gateway) as url:
            async with httpx.AsyncClient() as http:
                chat = await http.post(f"{url}/v1/chat/completions", json={"model": "smol", "messages": USER})
                text = await http.post(f"{url}/v1/completions", json={"model": "smol", "prompt": "Blue is"})
                return chat, text

    for r in run(go()):
        assert r.status_code == 200
        parts = dict(p.strip().split(";dur=") for p in r.headers["server-timing"].split(","))
        assert set(parts) == {"gateway", "engine"}
        assert 500 <= float(parts["engine"]) < 3000 and 0 < float(parts["gateway"]) < 500
