"""The LLM judge reward against a scripted server: parsing and validation, the clamp formula, per-metric scores
and costs, re-asks, and every failure (stopped, slow, malformed) recorded as a masked `judge` error."""

import asyncio
import json

import pytest

from turnrl.config import load_config
from turnrl.config.loader import ConfigError, build
from turnrl.config.schema import JudgeConfig
from turnrl.ledger import Segment, Source, Trajectory, Turn
from turnrl.llm import close_all
from turnrl.rewards.collab import conversation_reward
from turnrl.rewards.functions import RewardFunction, score_all
from turnrl.rewards.judge import ScoreParseError, parse_scores, render_conversation
from turnrl.rewards.measures import bleu, pass_rate


@pytest.fixture(autouse=True)
def fresh_pool():
    yield
    asyncio.run(close_all())


@pytest.mark.parametrize("text, expected", [
    ('{"accuracy": 1, "interactivity": 0.25}', {"accuracy": 1.0, "interactivity": 0.25}),
    ('Sure!\n```json\n{"accuracy": "0.5", "interactivity": 0, "why": {"a": 1}}\n```', {"accuracy": 0.5,
                                                                                     "interactivity": 0.0}),
    ('I think {not json} then {"interactivity": 0.1, "accuracy": 0.9} and {"accuracy": 0}',
     {"accuracy": 0.9, "interactivity": 0.1}),
])
def test_scores_come_from_the_first_json_object(text, expected):
    assert parse_scores(text, ["accuracy", "interactivity"]) == expected


@pytest.mark.parametrize("text, message", [
    ("The answer is good.", "no JSON object"),
    ('{"accuracy": 1}', r"missing key\(s\) \['interactivity'\]"),
    ('{"accuracy": 2, "interactivity": 0}', "outside"),
    ('{"accuracy": "high", "interactivity": 0}', "not a number"),
    ('{"accuracy": true, "interactivity": 0}', "not a number"),
    ('{"accuracy": null, "interactivity": 0}', "not a number"),
])
def test_invalid_scores_are_rejected(text, message):
    with pytest.raises(ScoreParseError, match=message):
        parse_scores(text, ["accuracy", "interactivity"])


def conversation(answer="The total is 285.", uid="g", tokens=6):
    traj = Trajectory(group_id=uid, sample_index=0, messages=[
        {"role": "system", "content": "be nice"}, {"role": "user", "content": "How much is my trip?"},
        {"role": "assistant", "content": answer}],
        info={"ground_truth": "285", "interaction": {"name": "llm_user", "task": "trip cost",
                                                     "goal": "3 nights at $80 plus $45"}})
    traj.segments = [Segment()]
    traj.segments[0].append([1, 2, 3], Source.PROMPT, 0)
    traj.segments[0].append(list(range(tokens)), Source.POLICY, 0, [0.0] * tokens)
    traj.turns = [Turn(0, 0, 3, 3 + tokens, "stop", answer)]
    traj.termination = "eos"
    return traj


def judge_reward(url, **over):
    values = {"llm": {"model": "judge-m", "base_url": url, "retries": 1, "backoff_s": 0.01, "timeout_s": 20.0},
              "metric_weights": {"accuracy": 1.0, "interactivity": 0.5, "token_amount": -0.1}, **over}
    cfg = build(JudgeConfig, values)
    return RewardFunction("judge", conversation_reward(cfg), cfg.weight)


def test_the_judge_reward_clamps_each_weighted_metric_and_records_costs(fake_openai):
    fake_openai.push(fake_openai.ok('{"accuracy": 1.0, "interactivity": 0.5}', prompt_tokens=100,
                                    completion_tokens=9))
    traj = conversation(tokens=6)
    asyncio.run(score_all([traj], [judge_reward(fake_openai.url)]))
    # 1.0*1 + 0.5*0.5 + clamp(-0.1*6 = -0.6) = 0.65
    assert traj.reward_parts["judge"] == pytest.approx(0.65) and traj.reward == pytest.approx(0.65)
    assert traj.metrics["judge/accuracy"] == 1.0 and traj.metrics["judge/token_amount"] == 6
    assert traj.metrics["judge/tokens"] == 109 and traj.metrics["judge/requests"] == 1
    assert traj.metrics["judge/futures"] == 0 and not traj.masked
    prompt = fake_openai.requests[0]["messages"][1]["content"]
    for needle in ("USER: How much is my trip?", "ASSISTANT: The total is 285.", "Reference answer: 285",
                   "3 nights at $80 plus $45", "- interactivity:", '{"accuracy": <0 to 1>, "interactivity": <0 to 1>}'):
        assert needle in prompt, needle
    assert "be nice" not in prompt  # the system prompt is not the assistant's doing
    big = conversation("It costs 300.", tokens=30)  # -0.1 * 30 = -3 is clamped to -1
    fake_openai.push(fake_openai.ok('{"accuracy": 0, "interactivity": 0}'))
    asyncio.run(score_all([big], [judge_reward(fake_openai.url)]))
    assert big.reward_parts["judge"] == pytest.approx(-1.0)


def test_a_malformed_reply_is_answered_and_asked_again(fake_openai):
    fake_openai.push(fake_openai.ok("Great answer, 10/10!"), fake_openai.ok('{"accuracy": 0, "interactivity": 1}'))
    traj = conversation()
    asyncio.run(score_all([traj], [judge_reward(fake_openai.url, metric_weights={"accuracy": 1.0,
                                                                                 "interactivity": 1.0})]))
    assert traj.reward_parts["judge"] == 1.0 and traj.metrics["judge/parse_failures"] == 1
    retry = fake_openai.requests[1]["messages"]
    assert retry[2] == {"role": "assistant", "content": "Great answer, 10/10!"}
    assert "not valid (no JSON object found)" in retry[3]["content"]


def test_prefill_starts_the_reply_in_the_format(fake_openai):
    fake_openai.push(fake_openai.ok('0.75, "interactivity": 0.5}'))
    traj = conversation()
    asyncio.run(score_all([traj], [judge_reward(fake_openai.url, json_prefill=True,
                                                metric_weights={"accuracy": 1.0, "interactivity": 1.0})]))
    body = fake_openai.requests[0]
    assert body["messages"][-1] == {"role": "assistant", "content": '{"accuracy": '}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert traj.reward_parts["judge"] == pytest.approx(1.25)


@pytest.mark.parametrize("fault", ["stopped", "slow", "not_json_body", "no_score", "out_of_range"])
def test_judge_failures_mask_only_the_affected_samples(fake_openai, closed_port_url, fault):
    good = '{"accuracy": 1, "interactivity": 1}'
    bad = {"slow": fake_openai.ok(good, delay=8.0), "not_json_body": (200, "<html>502</html>", 0),
           "no_score": fake_openai.ok('{"verdict": "fine"}'),
           "out_of_range": fake_openai.ok('{"accuracy": 7, "interactivity": 1}')}.get(fault)
    fake_openai.default = lambda body: bad if "BROKEN" in json.dumps(body) else fake_openai.ok(good)
    url = closed_port_url if fault == "stopped" else fake_openai.url
    trajs = [conversation("fine", uid="a"), conversation("BROKEN", uid="b"), conversation("fine too", uid="c")]
    asyncio.run(score_all(trajs, [judge_reward(url, llm={"model": "m", "base_url": url, "retries": 1,
                                                         "backoff_s": 0.01, "timeout_s": 2.0})]))
    broken = [t for t in trajs if t.masked]
    if fault == "stopped":
        assert len(broken) == 3  # no judge at all: every sample is an error, none is a zero
    else:
        assert [t.group_id for t in broken] == ["b"]
        assert all(t.reward_parts.get("judge") == pytest.approx(1.5 - 0.6) for t in trajs if not t.masked)
    for t in broken:
        assert "judge" not in t.reward_parts
        assert [e.kind for e in t.errors] == ["judge"] and t.mask_reason.startswith("judge: judge: judge failed")
    if fault in ("no_score", "out_of_range"):
        assert broken[0].metrics["judge/parse_failures"] == 2 and broken[0].metrics["judge/requests"] == 2


def test_unknown_metric_is_a_config_error_that_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"metric_weights.intention': unknown metric.*Valid: accuracy, "
                                          r"interactivity, token_amount, bleu, pass_rate"):
        load_config(None, ["reward.judge.llm.model=m", "reward.judge.metric_weights.intention=1"])
    with pytest.raises(ConfigError, match="Did you mean 'accuracy'"):
        load_config(None, ["reward.judge.llm.model=m", "reward.judge.metric_weights.acuracy=1"])
    with pytest.raises(ConfigError, match="judged by an LLM: set 'llm'"):
        load_config(None, ["reward.judge.metric_weights.accuracy=1"])
    cfg = load_config(None, ["reward.judge.metric_weights.token_amount=-0.001"])  # computed only: no LLM needed
    assert cfg.reward.judge.llm is None
    own = load_config(None, ["reward.judge.llm.model=m", "reward.judge.metrics.politeness=1 = polite, 0 = rude",
                             "reward.judge.metric_weights.politeness=0.5"])
    assert own.reward.judge.metric_weights == {"politeness": 0.5}


def test_own_metrics_and_rubric_files(fake_openai, tmp_path):
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Judge this:\n{conversation}\nGoal: {goal}\nScore {metrics}\nJSON like {example}")
    fake_openai.push(fake_openai.ok('{"politeness": 0.8}'))
    traj = conversation()
    asyncio.run(score_all([traj], [judge_reward(fake_openai.url, rubric=str(rubric),
                                                metrics={"politeness": "1 = polite, 0 = rude"},
                                                metric_weights={"politeness": 1.0})]))
    assert traj.reward_parts["judge"] == pytest.approx(0.8)
    prompt = fake_openai.requests[0]["messages"][1]["content"]
    assert prompt.startswith("Judge this:\nUSER:") and "Goal: 3 nights" in prompt
    assert "- politeness: 1 = polite" in prompt
    (tmp_path / "bad.txt").write_text("no placeholder")
    with pytest.raises(ConfigError, match="no {conversation} placeholder"):
        judge_reward(fake_openai.url, rubric=str(tmp_path / "bad.txt"))


def test_long_conversations_lose_their_middle():
    text = render_conversation([{"role": "user", "content": "a" * 500}, {"role": "assistant", "content": "b" * 500}],
                               200)
    assert text.startswith("USER: aaa") and text.endswith("bbb") and "characters left out" in text


def test_bleu_and_pass_rate():
    assert bleu("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    assert 0 < bleu("the cat sat on a mat today", "the cat sat on the mat") < 1
    assert bleu("dogs", "the cat sat") == 0.0 and bleu("", "x") == 0.0
    code = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "import time; time.sleep(5)"]
    assert asyncio.run(pass_rate(code, tests, timeout_s=3.0)) == pytest.approx(1 / 3)   # 3 s: starts under load


def test_bleu_and_pass_rate_as_judge_metrics_without_an_llm():
    traj = conversation("```python\ndef f():\n    return 285\n```")
    traj.info["extra"] = {"tests": ["assert f() == 285"]}
    cfg = build(JudgeConfig, {"metric_weights": {"pass_rate": 1.0, "bleu": 0.5}})
    asyncio.run(score_all([traj], [RewardFunction("judge", conversation_reward(cfg))]))
    assert traj.metrics["judge/pass_rate"] == 1.0 and 0 <= traj.metrics["judge/bleu"] < 0.2
    assert "judge/requests" not in traj.metrics
