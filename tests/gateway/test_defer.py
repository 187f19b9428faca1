"""Deferred commits: over HTTP the gateway answers first and writes the reply into the session's ledger after
the response is sent; every later use of the session settles it first, so nothing sees a half-recorded call and
the trajectory is the one an immediate commit makes."""

import asyncio

import httpx

from turnrl.chat.parsers import get_parser
from turnrl.gateway.requests import parse_chat
from turnrl.gateway.service import Defaults, Gateway

from tests.gateway.conftest import CALC, ScriptedEngine, served

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call>'
TEXTS = [CALL, "It is 391.", CALL, "#### 391"]
FIRST = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 17*23?"}]


def _next(messages, message, k):
    messages.append(message)
    if message.get("tool_calls"):
        messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "391"})
    else:
        messages.append({"role": "user", "content": f"Again, step {k}?"})


def _gateway(template):
    return Gateway(ScriptedEngine(template, TEXTS, 0.01), template, get_parser("hermes"), ["smol"], Defaults(), "split")


def _tokens(traj):
    return [(s.token_ids, s.sources, s.logprobs, s.loss_mask) for s in traj.segments]


def test_a_deferred_reply_is_committed_at_the_sessions_next_use(smol_template):
    gateway = _gateway(smol_template)

    async def go():
        session = gateway.open_session("row")
        messages = list(FIRST)
        answer = await gateway.chat(parse_chat({"model": "smol", "messages": messages, "tools": [CALC]}), session,
                                    defer=True)
        before = (session.calls, session.branches[0].busy, answer.session is session)
        _next(messages, answer.replies[0].message(), 0)
        second = await gateway.chat(parse_chat({"model": "smol", "messages": messages, "tools": [CALC]}), session,
                                    defer=True)
        during = session.calls   # the second call placed itself after settling the first
        gateway.session(session.id)   # any request's look-up settles
        return before, during, session.calls, second.session is session, gateway.close_session(session.id)

    before, during, after, deferred, traj = asyncio.run(go())
    assert before == (0, True, True)
    assert during == 1 and after == 2 and deferred
    assert [t.text for t in traj.turns] == TEXTS[:2] and len(traj.segments) == 1 and traj.parity == "exact"
    assert gateway.stats["guesses_used"] == 1 and gateway.stats["guesses_wrong"] == 0


def test_close_settles_and_an_immediate_commit_makes_the_same_trajectory(smol_template):
    async def agent(gateway, defer):
        session = gateway.open_session("row")
        messages = list(FIRST)
        for k in range(4):
            answer = await gateway.chat(parse_chat({"model": "smol", "messages": messages, "tools": [CALC]}),
                                        session, defer=defer)
            _next(messages, answer.replies[0].message(), k)
        return gateway.close_session(session.id)   # the last reply is still deferred here

    deferred, immediate = _gateway(smol_template), _gateway(smol_template)
    a, b = asyncio.run(agent(deferred, True)), asyncio.run(agent(immediate, False))
    assert len(a.turns) == 4 and _tokens(a) == _tokens(b) and a.parity == b.parity == "exact"
    assert deferred.engine.prompts == immediate.engine.prompts


def test_over_http_the_answer_goes_out_before_the_commit_and_fan_out_stays_apart(smol_template):
    """The route answers with the call still in flight in the session (busy), settles after sending; two
    concurrent calls on the same prompt still make two branches, and the closed ledger holds every reply."""
    gateway = _gateway(smol_template)
    seen = []
    real = gateway.chat

    async def chat(req, session=None, defer=False):
        answer = await real(req, session, defer)
        seen.append((defer, session.calls if session is not None else None))
        return answer
    gateway.chat = chat

    async def go():
        async with served(gateway) as url:
            async with httpx.AsyncClient() as http:
                sid = (await http.post(f"{url}/sessions")).json()["id"]
                post = lambda messages: http.post(f"{url}/sessions/{sid}/v1/chat/completions",  # noqa: E731
                                                  json={"model": "smol", "messages": messages, "tools": [CALC]})
                messages = list(FIRST)
                first = (await post(messages)).json()["choices"][0]["message"]
                _next(messages, first, 0)
                fan = await asyncio.gather(post(messages), post(messages))
                info = (await http.get(f"{url}/sessions/{sid}")).json()
                closed = (await http.post(f"{url}/sessions/{sid}/close")).json()
                return fan, info, closed

    fan, info, closed = asyncio.run(go())
    assert all(r.status_code == 200 for r in fan)
    assert seen[0] == (True, 0)   # the first answer was ready with nothing committed yet
    assert info["calls"] == 3 and info["branches"] == 2
    assert closed["parity"] == "exact" and len(closed["segments"]) == 2
    assert sorted(t["text"] for t in closed["turns"]) == sorted(TEXTS[:3])
