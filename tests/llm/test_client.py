"""The chat client against a scripted server: retries and backoff, timeouts, refused connections, malformed
bodies, the cache, the concurrency limit, API keys and accounting; and the local-engine backend on SmolLM2."""

import asyncio
import time

import pytest

from turnrl.config.loader import ConfigError, build, dump_yaml
from turnrl.config.schema import LLMConfig
from turnrl.llm import LLMError, close_all, usage_metrics
from turnrl.llm import client as pooled_client
from turnrl.llm.client import LLMClient, OpenAITransport, Retry

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True)
def fresh_pool():
    yield
    asyncio.run(close_all())


def make(url, retries=2, timeout_s=5.0, **kw):
    return LLMClient(OpenAITransport(url, "m", timeout_s=timeout_s), "m", retry=Retry(retries, 0.01, 0.05), **kw)


def test_a_reply_with_its_tokens_and_the_request_it_came_from(fake_openai):
    fake_openai.push(fake_openai.ok("hello there", prompt_tokens=12, completion_tokens=3))
    c = make(fake_openai.url, max_tokens=33)
    result = asyncio.run(c.chat(HI))
    assert (result.text, result.prompt_tokens, result.completion_tokens, result.attempts) == ("hello there", 12, 3, 1)
    body = fake_openai.requests[0]
    assert body["model"] == "m" and body["messages"] == HI and body["max_tokens"] == 33 and body["temperature"] == 0
    assert (c.usage.requests, c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.errors) == (1, 12, 3, 0)


def test_rate_limits_and_server_errors_are_retried_and_counted(fake_openai):
    fake_openai.push((429, {"error": "slow down"}, 0), (500, "oops", 0), (503, "busy", 0), fake_openai.ok("fine"))
    c = make(fake_openai.url, retries=3)
    result = asyncio.run(c.chat(HI))
    assert result.text == "fine" and result.attempts == 4
    assert (c.usage.retries, c.usage.requests, c.usage.errors) == (3, 1, 0)
    assert len(fake_openai.requests) == 4


def test_retries_run_out_into_an_error_that_says_why(fake_openai):
    fake_openai.default = lambda body: (500, "internal error", 0)
    c = make(fake_openai.url, retries=2)
    with pytest.raises(LLMError, match="after 3 attempt.*HTTP 500"):
        asyncio.run(c.chat(HI))
    assert len(fake_openai.requests) == 3 and (c.usage.errors, c.usage.retries, c.usage.requests) == (1, 2, 0)


def test_a_bad_request_is_not_retried(fake_openai):
    fake_openai.push((400, {"error": "context too long"}, 0))
    c = make(fake_openai.url, retries=3)
    with pytest.raises(LLMError, match="HTTP 400.*context too long"):
        asyncio.run(c.chat(HI))
    assert len(fake_openai.requests) == 1


def test_a_slow_server_times_out_per_attempt(fake_openai):
    fake_openai.default = lambda body: fake_openai.ok("late", delay=3.0)
    c = make(fake_openai.url, retries=1, timeout_s=0.3)
    start = time.perf_counter()
    with pytest.raises(LLMError, match="timed out after 0.3s"):
        asyncio.run(c.chat(HI))
    assert time.perf_counter() - start < 2.5
    deadline = time.monotonic() + 2        # the server may log the second attempt after the client gave up on it
    while len(fake_openai.requests) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(fake_openai.requests) == 2


def test_a_stopped_server_is_an_error_not_a_hang(closed_port_url):
    c = make(closed_port_url, retries=1)
    with pytest.raises(LLMError, match="ConnectError"):
        asyncio.run(c.chat(HI))
    assert c.usage.errors == 1 and c.usage.retries == 1


def test_a_malformed_body_is_retried_then_an_error(fake_openai):
    fake_openai.push((200, "<html>proxy error</html>", 0), (200, {"choices": []}, 0), fake_openai.ok("ok"))
    assert asyncio.run(make(fake_openai.url, retries=2).chat(HI)).text == "ok"
    fake_openai.default = lambda body: (200, "not json at all", 0)
    with pytest.raises(LLMError, match="malformed response body"):
        asyncio.run(make(fake_openai.url, retries=1).chat(HI))


def test_retry_after_is_honoured_within_the_cap():
    assert Retry(3, 0.5, 8.0).delay(0, 2.0) == 2.0 and Retry(3, 0.5, 8.0).delay(0, 60.0) == 8.0
    delays = [Retry(5, 0.5, 4.0).delay(k, None) for k in range(5)]
    assert 0.25 <= delays[0] <= 0.75 and all(d <= 6.0 for d in delays)


def test_the_cache_serves_temperature_zero_only(fake_openai, tmp_path):
    fake_openai.default = lambda body: fake_openai.ok(f"answer {len(fake_openai.requests)}")
    path = tmp_path / "cache.jsonl"
    c = make(fake_openai.url, cache_path=str(path))

    async def go():
        a, b = await c.chat(HI), await c.chat(HI)
        same = await asyncio.gather(*(c.chat([{"role": "user", "content": "x"}]) for _ in range(3)))  # in flight
        s1, s2 = await c.chat(HI, temperature=0.7), await c.chat(HI, temperature=0.7)
        return a, b, same, s1, s2
    a, b, same, s1, s2 = asyncio.run(go())
    assert a.text == b.text and b.cached and not a.cached
    assert len({r.text for r in same}) == 1 and sum(r.cached for r in same) == 2
    assert s1.text != s2.text and not s1.cached
    assert len(fake_openai.requests) == 4 and c.usage.cache_hits == 3 and c.usage.requests == 7
    again = make(fake_openai.url, cache_path=str(path))  # a new run reads the file
    assert asyncio.run(again.chat(HI)).text == a.text and len(fake_openai.requests) == 4


def test_concurrency_is_limited(fake_openai):
    fake_openai.default = lambda body: fake_openai.ok("x", delay=0.15)
    c = make(fake_openai.url, max_concurrency=2, cache=False)

    async def go():
        await asyncio.gather(*(c.chat([{"role": "user", "content": str(i)}]) for i in range(6)))
    asyncio.run(go())
    assert fake_openai.max_in_flight == 2 and c.usage.requests == 6


def test_the_key_comes_by_reference_and_is_never_shown(fake_openai, monkeypatch, tmp_path):
    monkeypatch.setenv("TURNRL_TEST_KEY", "sk-secret-123")
    cfg = build(LLMConfig, {"model": "m", "base_url": fake_openai.url, "api_key": "env:TURNRL_TEST_KEY"})
    fake_openai.push(fake_openai.ok("ok"))
    c = pooled_client(cfg, "judge")
    asyncio.run(c.chat(HI))
    assert fake_openai.headers[0]["Authorization"] == "Bearer sk-secret-123"
    assert "sk-secret" not in repr(c.transport) and "sk-secret" not in dump_yaml(cfg)
    keyfile = tmp_path / "key"
    keyfile.write_text("sk-from-file\n")
    fake_openai.push(fake_openai.ok("ok"))
    asyncio.run(pooled_client(build(LLMConfig, {"model": "m", "base_url": fake_openai.url,
                                                "api_key": f"file:{keyfile}"}), "judge").chat(HI))
    assert fake_openai.headers[1]["Authorization"] == "Bearer sk-from-file"
    monkeypatch.delenv("TURNRL_TEST_KEY")
    with pytest.raises(ConfigError, match="TURNRL_TEST_KEY, which is not set"):
        pooled_client(build(LLMConfig, {"model": "other", "base_url": fake_openai.url,
                                        "api_key": "env:TURNRL_TEST_KEY"}), "judge")
    fake_openai.push(fake_openai.ok("ok"))
    asyncio.run(pooled_client(build(LLMConfig, {"model": "m", "base_url": fake_openai.url}), "user").chat(HI))
    assert "Authorization" not in fake_openai.headers[2]  # a local server without keys


@pytest.mark.parametrize("values, message", [
    ({"model": ""}, "'model' is required"),
    ({"model": "m", "api_key": "sk-abc-123"}, "must refer to the key, not hold it"),
    ({"model": "m", "base_url": "localhost:8000"}, "must start with http"),
    ({"model": "m", "max_concurrency": 0}, "max_concurrency"),
])
def test_llm_config_is_validated(values, message):
    with pytest.raises(ConfigError, match=message):
        build(LLMConfig, values)


def test_the_pool_shares_clients_and_reports_usage_per_role(fake_openai):
    fake_openai.default = lambda body: fake_openai.ok("x", prompt_tokens=5, completion_tokens=2)
    cfg = build(LLMConfig, {"model": "m", "base_url": fake_openai.url, "cache": False})
    assert pooled_client(cfg, "user") is pooled_client(cfg, "user")
    assert pooled_client(cfg, "judge") is not pooled_client(cfg, "user")
    asyncio.run(pooled_client(cfg, "user").chat(HI))
    asyncio.run(pooled_client(cfg, "user").chat(HI))
    first = usage_metrics()
    assert first["llm/user/requests"] == 2 and first["llm/user/prompt_tokens"] == 10
    assert first["llm/judge/requests"] == 0
    assert usage_metrics()["llm/user/requests"] == 0  # only what happened since the last report


def test_the_local_backend_serves_chat_from_a_frozen_engine(smollm2_dir):
    cfg = build(LLMConfig, {"backend": "local", "model": str(smollm2_dir), "max_tokens": 12, "dtype": "float32"})
    c = pooled_client(cfg, "judge")
    assert pooled_client(build(LLMConfig, {**vars(cfg), "max_tokens": 20}), "user").transport._engine() \
        is c.transport._engine()  # one model in memory for both

    async def go():
        a = await c.chat([{"role": "user", "content": "What is the capital of France?"}])
        b = await c.chat([{"role": "user", "content": "What is the capital of France?"}])
        p = await c.chat([{"role": "user", "content": "Rate it."}], prefill='{"score": ')
        return a, b, p
    a, b, p = asyncio.run(go())
    assert a.text and "<|im_end|>" not in a.text and a.completion_tokens <= 12 and a.prompt_tokens > 5
    assert b.cached and b.text == a.text
    assert not p.text.startswith('{"score"')  # the prefill is the caller's: only the continuation comes back
