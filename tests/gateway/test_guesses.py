"""The gateway samples from a guessed prompt while it places the call, and uses the sample only if the guess
was the call's prompt: the ledger is the same as without guessing, and a wrong guess is thrown away."""

import asyncio
import copy

from turnrl.chat.parsers import get_parser
from turnrl.chat.templates import ChatTemplate
from turnrl.gateway.capture import Session
from turnrl.gateway.requests import parse_chat
from turnrl.gateway.service import Defaults, Gateway

from tests.gateway.conftest import CALC, ScriptedEngine

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call>'
SYSTEM = {"role": "system", "content": "Use the calculator."}


async def agent(gateway, turns):
    """Call, echo the reply, answer its tool call (or ask again), `turns` times; -> the closed trajectory."""
    session = gateway.open_session("row")
    messages = [SYSTEM, {"role": "user", "content": "What is 17*23?"}]
    for k in range(turns):
        answer = await gateway.chat(parse_chat({"model": "smol", "messages": messages, "tools": [CALC]}), session)
        message = answer.replies[0].message()
        messages.append(message)
        if message.get("tool_calls"):
            messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "391"})
        else:
            messages.append({"role": "user", "content": f"Again, step {k}?"})
    return gateway.close_session(session.id)


def test_guessed_prompts_are_used_and_the_ledger_is_the_same_as_without_them(smol_template, monkeypatch):
    texts = [CALL, "It is 391.", CALL, "#### 391"]
    guessing = Gateway(ScriptedEngine(smol_template, texts, 0.01), smol_template, get_parser("hermes"), ["smol"],
                       Defaults(), "split")
    traj = asyncio.run(agent(guessing, 4))
    assert guessing.stats["guesses_used"] == 3 and guessing.stats["guesses_wrong"] == 0
    assert guessing.engine.cancelled == 0 and len(guessing.engine.prompts) == 4
    seg = traj.segment
    for prompt in guessing.engine.prompts:   # every prompt sampled from is the ledger up to that call
        assert seg.token_ids[:len(prompt)] == prompt
    monkeypatch.setattr(Session, "guess", lambda *a: None)
    plain = Gateway(ScriptedEngine(smol_template, texts, 0.01), smol_template, get_parser("hermes"), ["smol"],
                    Defaults(), "split")
    other = asyncio.run(agent(plain, 4))
    assert plain.stats["guesses_used"] == 0
    assert plain.engine.prompts == guessing.engine.prompts
    assert [(s.token_ids, s.sources, s.logprobs) for s in other.segments] == \
        [(s.token_ids, s.sources, s.logprobs) for s in traj.segments]
    assert traj.parity == other.parity == "exact"


def test_a_wrong_guess_is_cancelled_and_the_call_samples_from_its_own_prompt(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)   # ChatML that trims what it renders: a guess that pastes raw text is wrong
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    template = ChatTemplate(tok)
    engine = ScriptedEngine(template, ["one", "two", "three"], 0.05)
    gateway = Gateway(engine, template, get_parser("hermes"), ["smol"], Defaults(), "split")

    async def run():
        session = gateway.open_session()
        messages = [{"role": "user", "content": "hi"}]
        for k in range(3):
            answer = await gateway.chat(parse_chat({"model": "smol", "messages": messages}), session)
            messages += [answer.replies[0].message(), {"role": "user", "content": f"  more {k}  "}]
        return gateway.close_session(session.id)
    traj = asyncio.run(run())
    # call 2's guess was wrong: cancelled, sampled again; call 3 is not guessed for that shape again
    assert gateway.stats["guesses_wrong"] == 1 and gateway.stats["guesses_used"] == 0
    assert engine.cancelled == 1 and len(engine.prompts) == 4
    assert engine.prompts[1] != engine.prompts[2]
    assert [r.text for r in traj.turns] == ["one", "two", "three"]
    seg = traj.segment
    for prompt in (engine.prompts[0], engine.prompts[2], engine.prompts[3]):
        assert seg.token_ids[:len(prompt)] == prompt
    assert template.decode(engine.prompts[2]).endswith("<|im_start|>user\nmore 0<|im_end|>\n<|im_start|>assistant\n")
    assert traj.parity == "exact"


def test_a_call_cancelled_while_its_guess_starts_cancels_the_guess_too(smol_template):
    engine = ScriptedEngine(smol_template, ["one", "two"], 0.5)
    gateway = Gateway(engine, smol_template, get_parser("hermes"), ["smol"], Defaults(), "split")

    async def run():
        session = gateway.open_session()
        messages = [{"role": "user", "content": "hi"}]
        first = await gateway.chat(parse_chat({"model": "smol", "messages": messages}), session)
        messages += [first.replies[0].message(), {"role": "user", "content": "more"}]
        task = asyncio.ensure_future(gateway.chat(parse_chat({"model": "smol", "messages": messages}), session))
        await asyncio.sleep(0)   # the call has submitted its guess and yields once for the engine to take it
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert len(engine.prompts) == 2 and engine.cancelled == 1   # the guessed request was aborted at once
        return session
    session = asyncio.run(run())
    assert session.calls == 1 and gateway.close_session(session.id).metrics["gateway/calls"] == 1
