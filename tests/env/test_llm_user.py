"""The LLM-simulated user against a scripted server: the role-play prompt, swapped roles, reply parsing, the
termination marker, max_turns, per-reply cost, and failures raised for the agent loop to record."""

import asyncio

import pytest

from turnrl.config.loader import ConfigError
from turnrl.config.schema import InteractionSpec
from turnrl.env.builtin.llm_user import LLMUser, parse_reply
from turnrl.env.interactions import Interaction
from turnrl.env.loading import interaction_factory
from turnrl.llm import LLMError, close_all, usage_metrics

MARK = "[[TERMINATE CHAT]]"


@pytest.fixture(autouse=True)
def fresh_pool():
    yield
    asyncio.run(close_all())


@pytest.mark.parametrize("raw, expected", [
    ("My budget is $500.", ("My budget is $500.", False, "text")),
    ('User: "It is for my sister."', ("It is for my sister.", False, "text")),
    ('{"thought": "they asked", "response": "Three nights.", "current_answer": ""}', ("Three nights.", False, "json")),
    (f"Thanks, that is all! {MARK}", ("Thanks, that is all!", True, "text")),
    (MARK, ("", True, "text")),
    (f'{{"response": "Perfect. {MARK}"}}', ("Perfect.", True, "json")),
])
def test_replies_are_parsed(raw, expected):
    assert parse_reply(raw, MARK) == expected


def user(url, **config):
    return LLMUser(llm={"model": "user-m", "base_url": url, "retries": 0, "timeout_s": 5.0, "temperature": 0.7},
                   **config)


def test_the_user_role_plays_the_hidden_goal_with_swapped_roles(fake_openai):
    fake_openai.push(fake_openai.ok("It is 3 nights at $80.", prompt_tokens=40, completion_tokens=8))
    u = user(fake_openai.url)
    assert isinstance(u, Interaction)
    u.start(task="Work out what my trip costs.", goal="3 nights at $80 and a $45 train ticket")
    conversation = [{"role": "system", "content": "You are helpful."},
                    {"role": "user", "content": "How much will my trip cost?"},
                    {"role": "assistant", "content": "How many nights, and at what price?"}]
    reply = asyncio.run(u.respond(conversation))
    assert (reply.text, reply.done) == ("It is 3 nights at $80.", False)
    assert reply.info == {"user_prompt_tokens": 40, "user_completion_tokens": 8, "user_cached": False,
                          "user_format": "text"}
    sent = fake_openai.requests[0]["messages"]
    assert sent[0]["role"] == "system" and "Work out what my trip costs." in sent[0]["content"]
    assert "3 nights at $80 and a $45 train ticket" in sent[0]["content"] and MARK in sent[0]["content"]
    assert sent[1:] == [{"role": "assistant", "content": "How much will my trip cost?"},
                        {"role": "user", "content": "How many nights, and at what price?"}]
    assert fake_openai.requests[0]["temperature"] == 0.7
    assert usage_metrics()["llm/user/requests"] == 1


def test_the_marker_and_max_turns_end_the_conversation(fake_openai):
    fake_openai.default = lambda body: fake_openai.ok("Tell me more.")
    u = user(fake_openai.url, max_turns=2)
    u.start(task="t", goal="g")
    first = asyncio.run(u.respond([{"role": "assistant", "content": "a"}]))
    second = asyncio.run(u.respond([{"role": "assistant", "content": "b"}]))
    assert not first.done and second.done
    fake_openai.default = lambda body: fake_openai.ok(f"Great, thanks. {MARK}")
    u.start(task="t", goal="g")
    assert asyncio.run(u.respond([{"role": "assistant", "content": "c"}])).done


def test_failures_raise_for_the_loop_to_record(fake_openai, closed_port_url):
    fake_openai.push(fake_openai.ok("   "))
    u = user(fake_openai.url)
    u.start(task="t", goal="g")
    with pytest.raises(ValueError, match="reply is empty"):
        asyncio.run(u.respond([{"role": "assistant", "content": "a"}]))
    down = user(closed_port_url)
    down.start(task="t", goal="g")
    with pytest.raises(LLMError, match="ConnectError"):
        asyncio.run(down.respond([{"role": "assistant", "content": "a"}]))
    with pytest.raises(ValueError, match="needs interaction kwargs"):
        u.start(goal="only a goal")


def test_config_errors_are_precise(tmp_path):
    with pytest.raises(ConfigError, match="Missing required config key.*llm"):
        LLMUser()
    with pytest.raises(ConfigError, match="llm_user config.llm.tempreture"):
        LLMUser(llm={"model": "m", "tempreture": 0})
    with pytest.raises(ConfigError, match="prompt file"):
        LLMUser(llm={"model": "m"}, prompt=str(tmp_path / "missing.txt"))
    prompt = tmp_path / "p.txt"
    prompt.write_text("Be a grumpy user. You want: {goal}. Say {marker} when done.")
    u = LLMUser(llm={"model": "m"}, prompt=str(prompt))
    u.start(task="t", goal="a refund")
    assert u.system == f"Be a grumpy user. You want: a refund. Say {MARK} when done."


def test_it_is_a_built_in_interaction(fake_openai):
    make = interaction_factory(InteractionSpec("sim", "llm_user", {"llm": {"model": "m", "base_url": fake_openai.url}}))
    a, b = make(), make()
    assert isinstance(a, LLMUser) and a is not b and a.client is b.client  # own state, one shared client
