"""CollabLLM's conversation-level reward: futures sampled concurrently from one shared prefix by the policy and
the LLM-simulated user, judged, aggregated with the clamp formula, never trained on; failures recorded; and
the whole workflow in the trainer (tiny policy, scripted endpoints) writing its metrics."""

import asyncio
import json

import pytest

from turnrl.config import load_config
from turnrl.config.loader import build
from turnrl.config.schema import InteractionSpec, JudgeConfig, RolloutConfig, SamplingConfig
from turnrl.data import Task
from turnrl.engines.base import Completion, EngineBase
from turnrl.ledger import Source
from turnrl.llm import close_all
from turnrl.rewards.collab import RolloutContext, conversation_reward
from turnrl.rewards.functions import RewardFunction, score_all
from turnrl.rollout.factory import build_environment, build_loop
from turnrl.train.trainer import Trainer

MARK = "[[TERMINATE CHAT]]"


@pytest.fixture(autouse=True)
def fresh_pool():
    yield
    asyncio.run(close_all())


class Policy(EngineBase):
    """A policy engine that asks a question every turn; records prompts and how many requests overlap."""

    def __init__(self, template):
        self.template = template
        self.prompts = []
        self.in_flight = self.max_in_flight = 0
        self.hold = 0      # > 0: a call waits (up to 5 s) until that many are in flight, then they go on together

    async def generate(self, prompt_ids, sampling):
        self.prompts.append(list(prompt_ids))
        number = len(self.prompts)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        for _ in range(500 if self.hold else 5):
            if self.hold and self.in_flight >= self.hold:
                self.hold = 0
            await asyncio.sleep(0.01)
        self.in_flight -= 1
        ids = self.template.encode(f"Question {number}: what is your budget?")
        ids = ids[:sampling.max_tokens - 1] + [self.template.stop_token_ids[0]]
        return Completion(ids, [-0.5] * len(ids), "stop")

    async def close(self):
        pass


def endpoints(fake, user_reply="About $500.", judge_reply='{"accuracy": 0.5, "interactivity": 1.0}'):
    """The fake server plays the judge (system prompt 'impartial evaluator') and the user (everything else)."""
    def answer(body):
        if "impartial evaluator" in body["messages"][0]["content"]:
            return judge_reply(body) if callable(judge_reply) else fake.ok(judge_reply, 120, 10)
        return user_reply(body) if callable(user_reply) else fake.ok(user_reply, 60, 5)
    fake.default = answer


def setup(fake, template, futures=3, future_turns=2, weights=None):
    llm = {"model": "m", "base_url": fake.url, "retries": 0, "timeout_s": 10.0}
    rollout = RolloutConfig(n=1, max_assistant_turns=1, max_response_tokens=200, max_context_tokens=2048,
                            sampling=SamplingConfig(max_tokens_per_turn=32),
                            interactions=[InteractionSpec("llm_user", "llm_user",
                                                          {"llm": {**llm, "temperature": 0.7}, "max_turns": 5})])
    env = build_environment(rollout)
    engine = Policy(template)
    judge = build(JudgeConfig, {"llm": llm, "num_repeat_rollouts": futures, "max_future_turns": future_turns,
                                "metric_weights": weights or {"accuracy": 1.0, "interactivity": 0.5,
                                                              "token_amount": -0.01}})
    reward = RewardFunction("judge", conversation_reward(judge, RolloutContext(engine, template, env, rollout, seed=0)))
    loop = build_loop(rollout, engine, template, env, seed=0)
    task = Task("trip-0", [{"role": "user", "content": "How much will my trip cost?"}], tools=[],
                interaction={"name": "llm_user", "task": "trip cost", "goal": "3 nights at $80"}, ground_truth="240")
    return engine, reward, loop, task


def test_futures_share_the_prefix_run_concurrently_and_are_not_trained_on(fake_openai, smol_template):
    endpoints(fake_openai)
    engine, reward, loop, task = setup(fake_openai, smol_template)
    traj = asyncio.run(loop.run(task))
    assert traj.termination == "max_assistant_turns" and traj.turns[-1].user_reply == "About $500."
    ledger = [list(s.token_ids) for s in traj.segments]
    engine.prompts.clear()
    engine.max_in_flight, engine.hold = 0, 3    # the three futures' first calls wait for each other (not a timer)
    user_calls = len(fake_openai.requests)
    asyncio.run(score_all([traj], [reward]))
    assert not traj.masked, traj.errors
    assert [list(s.token_ids) for s in traj.segments] == ledger  # futures never enter the trajectory
    assert traj.metrics["judge/futures"] == 3 and traj.metrics["judge/failed_futures"] == 0
    assert traj.metrics["judge/future_turns"] == 2 and traj.metrics["judge/requests"] == 3
    assert traj.metrics["judge/tokens"] == 3 * 130
    # The three futures' first prompts are the same ids (the recorded user reply is the shared prefix) and
    # were in flight together.
    first = engine.prompts[:3]
    assert first[0] == first[1] == first[2] and engine.max_in_flight == 3
    assert smol_template.decode(first[0]).count("About $500.") == 1
    # Futures did not re-ask the user for the shared reply: 2 future turns -> 2 user calls each (the loop asks
    # after every assistant turn), 3 judge calls.
    assert len(fake_openai.requests) - user_calls == 3 * 2 + 3
    futures = traj.metrics["judge_futures"]
    assert len(futures) == 3 and [m["role"] for m in futures[0]] == ["assistant", "user", "assistant"]
    judged = fake_openai.requests[-1]["messages"][1]["content"]
    assert judged.count("ASSISTANT: Question") == 3  # the trajectory's turn plus the future's two
    tokens = traj.n_tokens(Source.POLICY) * 3   # each turn of the policy writes the same number of tokens here
    assert traj.metrics["judge/token_amount"] == tokens
    assert traj.reward_parts["judge"] == pytest.approx(0.5 + 0.5 + max(-1.0, -0.01 * tokens))


def test_a_finished_conversation_is_its_own_future(fake_openai, smol_template):
    endpoints(fake_openai, user_reply=f"That's all, thanks! {MARK}")
    engine, reward, loop, task = setup(fake_openai, smol_template)
    traj = asyncio.run(loop.run(task))
    assert traj.termination == "interaction_done"
    engine.prompts.clear()
    asyncio.run(score_all([traj], [reward]))
    assert traj.metrics["judge/futures"] == 0 and not engine.prompts and traj.metrics["judge/requests"] == 1


def test_failed_futures_are_left_out_or_make_a_recorded_error(fake_openai, smol_template):
    calls = {"n": 0}

    def flaky_user(body):
        calls["n"] += 1
        return (500, "down", 0) if calls["n"] in (2, 3) else fake_openai.ok("Go on.")
    endpoints(fake_openai, user_reply=flaky_user)
    engine, reward, loop, task = setup(fake_openai, smol_template, futures=3, future_turns=2)
    traj = asyncio.run(loop.run(task))  # user call 1
    asyncio.run(score_all([traj], [reward]))  # calls 2 and 3 fail: two futures lose their user
    assert not traj.masked and traj.metrics["judge/failed_futures"] == 2 and traj.metrics["judge/futures"] == 3
    endpoints(fake_openai, user_reply=lambda body: (500, "down", 0))
    engine, reward, loop, task = setup(fake_openai, smol_template, futures=2, future_turns=2)
    fake_openai.push(fake_openai.ok("Go on."))  # the rollout's own user reply works, then the user goes down
    traj = asyncio.run(loop.run(task))
    asyncio.run(score_all([traj], [reward]))
    assert traj.masked and [e.kind for e in traj.errors] == ["judge"]
    assert "all 2 futures failed: interaction: respond failed" in traj.errors[0].message
    assert "judge" not in traj.reward_parts


def test_futures_need_the_policy(fake_openai, smol_template):
    endpoints(fake_openai)
    engine, reward, loop, task = setup(fake_openai, smol_template)
    traj = asyncio.run(loop.run(task))
    unbound = RewardFunction("judge", conversation_reward(build(JudgeConfig, {
        "llm": {"model": "m", "base_url": fake_openai.url}, "num_repeat_rollouts": 2,
        "metric_weights": {"accuracy": 1.0}})))
    asyncio.run(score_all([traj], [unbound]))
    assert traj.masked and "needs the policy's engine" in traj.errors[0].message


def collab_config(tmp_path, user_url, judge_url, steps=2):
    data = tmp_path / "tasks.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Help me plan trip {i}."}],
                                          "interaction": {"name": "llm_user", "task": f"trip {i}", "goal": "cheap"},
                                          "ground_truth": "500"}) for i in range(4)))
    user, judge = (f"{{model: m, base_url: '{url}', retries: 0}}" for url in (user_url, judge_url))
    return load_config(None, [
        "model.name=tiny-random", "engine.dtype=float32", "trainer.dtype=float32", f"data.train.path={data}",
        "data.prompts_per_step=2", "rollout.n=2", "rollout.max_assistant_turns=1", "rollout.max_response_tokens=60",
        "rollout.sampling.max_tokens_per_turn=8",
        f"rollout.interactions=[{{name: llm_user, class_name: llm_user, config: {{llm: {user}}}}}]",
        f"reward.judge.llm={judge}", "reward.judge.metric_weights={accuracy: 1.0, interactivity: 0.5, "
                                     "token_amount: -0.001}",
        "reward.judge.num_repeat_rollouts=2", "reward.judge.max_future_turns=1", f"trainer.steps={steps}",
        "trainer.optim.lr=1e-3", "logging.sinks=[]", "logging.progress=off", f"output_dir={tmp_path / 'run'}"])


def test_the_collab_workflow_trains_and_logs_its_metrics(fake_openai, tmp_path):
    def judge(body):  # scores that vary with the conversation, so the policy gets a signal
        accuracy = len(body["messages"][1]["content"]) % 7 / 7
        return fake_openai.ok(json.dumps({"accuracy": accuracy, "interactivity": 0.5}), 200, 12)
    endpoints(fake_openai, user_reply=lambda body: fake_openai.ok(f"My budget is {len(body['messages'])}00 dollars."),
              judge_reply=judge)
    cfg = collab_config(tmp_path, fake_openai.url, fake_openai.url)
    history = asyncio.run(Trainer(cfg).run())
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert line["judge/futures"] == 2 and line["judge/tokens"] > 0 and line["judge/requests"] == 2
        for key in ("reward/judge", "judge/accuracy", "judge/interactivity", "judge/token_amount",
                    "llm/judge/prompt_tokens", "llm/user/requests", "llm/user/completion_tokens"):
            assert key in line, key
        assert line["llm/judge/requests"] == 4 * 2 and line["masked"] == 0
    assert history[-1]["grad_norm"] > 0


def test_a_judge_that_is_down_masks_the_step_and_training_goes_on(fake_openai, closed_port_url, tmp_path):
    endpoints(fake_openai)
    history = asyncio.run(Trainer(collab_config(tmp_path, fake_openai.url, closed_port_url, steps=1)).run())
    assert history[0]["masked"] == 4 and history[0]["errors/judge"] == 4 and "reward/judge" not in history[0]
    assert history[0]["llm/judge/errors"] == 8 and history[0]["judge/futures"] == 2  # 2 futures each, all judged
    trajs = [json.loads(x) for x in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert all(t["masked"] and "ConnectError" in t["errors"][0]["message"] for t in trajs)


def test_the_example_tasks_are_generated_and_its_config_loads():
    import importlib.util
    from pathlib import Path

    from turnrl.data.rows import load_rows
    root = Path(__file__).parents[2] / "examples" / "collab"
    spec = importlib.util.spec_from_file_location("make_tasks", root / "make_tasks.py")
    make_tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tasks)
    committed = [json.loads(x) for x in (root / "tasks.jsonl").read_text().splitlines()]
    assert committed == make_tasks.rows(60, 0)  # the file is what the generator writes
    tasks = load_rows(root / "tasks.jsonl")
    assert {t.data_source for t in tasks} == {"collab_cost", "collab_message", "collab_choice"}
    assert all(t.interaction["name"] == "llm_user" and t.interaction["goal"] for t in tasks)
    head = (root / "train.yaml").read_text().splitlines()[0]
    assert head == "# turnrl train examples/collab/train.yaml"
    cfg = load_config(str(root / "train.yaml"), [])
    assert cfg.reward.judge.num_repeat_rollouts == 2 and cfg.reward.judge.llm.backend == "local"
    assert cfg.rollout.interactions[0].config["llm"]["backend"] == "local"
