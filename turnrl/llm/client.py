"""One chat client for judges and simulated users: an OpenAI-compatible endpoint or a local turnrl engine.

`LLMClient.chat(messages)` returns a `ChatResult` (text, finish reason, token counts) or raises `LLMError`.
Around the transport it adds what every caller needs:
- a concurrency limit (a semaphore per event loop);
- retries with exponential backoff and jitter on rate limits (429), server errors (5xx), timeouts, refused
  connections and malformed response bodies: attempt k (from 0) waits
  min(backoff_max_s, backoff_s * 2**k) * U(0.5, 1.5), or the server's `Retry-After` when it sends one
  (capped at backoff_max_s). Other 4xx answers (a bad request) fail at once;
- a response cache keyed by (model, messages, prefill, max_tokens, extra body), used only at temperature 0
  (a sampled answer is not a function of its request), in memory and optionally in a JSONL file; identical
  requests in flight at the same time share one call;
- accounting (`Usage`): requests, cache hits, retries, errors, prompt/completion tokens, seconds.

`prefill` starts the reply with given text (the caller gets only what follows it): a local engine renders it
after the generation prompt; an OpenAI-compatible server gets it as a final assistant message with vLLM's
`continue_final_message` (servers without that extension reject the request, a non-retried 400).

Two transports: `OpenAITransport` (httpx, `POST {base_url}/chat/completions`, the key given by reference:
`env:NAME` or `file:PATH`) and `EngineTransport` (a frozen local copy of a model behind a turnrl `Engine`, rendered
with its chat template: a run needs no external service).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from turnrl.engines.base import EngineError, Sampling
from turnrl.engines import resume

RETRY_STATUS = (429, 500, 502, 503, 504)


class LLMError(RuntimeError):
    """A chat call that failed for good (after its retries, or at once when retrying cannot help)."""


class Retryable(Exception):
    """A transport failure worth another attempt; `retry_after` is the server's hint in seconds."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class ChatResult:
    text: str
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: bool = False
    attempts: int = 1
    seconds: float = 0.0


@dataclass
class Usage:
    requests: int = 0            # answered calls, from the endpoint or the cache
    cache_hits: int = 0
    retries: int = 0             # extra attempts after a retryable failure
    errors: int = 0              # calls that failed for good
    prompt_tokens: int = 0       # as reported by the endpoint (cache hits count nothing)
    completion_tokens: int = 0
    seconds: float = 0.0

    def add(self, other: "Usage") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def minus(self, other: "Usage") -> "Usage":
        return Usage(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)})


class Transport(Protocol):
    async def __call__(self, messages: list[dict[str, Any]], prefill: str, max_tokens: int,
                       temperature: float) -> ChatResult: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class Retry:
    retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0

    def delay(self, attempt: int, hint: float | None) -> float:
        if hint is not None:
            return min(max(hint, 0.0), self.backoff_max_s)
        return min(self.backoff_max_s, self.backoff_s * 2 ** attempt) * random.uniform(0.5, 1.5)


class LLMClient:
    def __init__(self, transport: Transport, model: str, temperature: float = 0.0, max_tokens: int = 256,
                 max_concurrency: int = 8, retry: Retry = Retry(), cache: bool = True, cache_path: str | None = None,
                 cache_extra: Any = None):
        self.transport = transport
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.max_concurrency = max_concurrency
        self.retry = retry
        self.use_cache = cache
        self.cache_extra = cache_extra          # request fields beyond the messages that change the answer
        self.usage = Usage()
        self._cache: dict[str, dict[str, Any]] = {}
        self._cache_path = Path(cache_path) if cache_path else None
        if self._cache_path is not None and self._cache_path.is_file():
            for line in self._cache_path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                    self._cache[entry["key"]] = entry["result"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a torn last line from a killed run
        self._per_loop: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Semaphore, dict[str, asyncio.Future]]] = {}

    def _loop_state(self) -> tuple[asyncio.Semaphore, dict[str, asyncio.Future]]:
        loop = asyncio.get_running_loop()
        state = self._per_loop.get(id(loop))
        if state is None or state[0] is not loop:
            self._per_loop = {k: v for k, v in self._per_loop.items() if not v[0].is_closed()}
            state = self._per_loop[id(loop)] = (loop, asyncio.Semaphore(self.max_concurrency), {})
        return state[1], state[2]

    def _key(self, messages: list[dict[str, Any]], prefill: str, max_tokens: int) -> str:
        blob = json.dumps([self.model, messages, prefill, max_tokens, self.cache_extra], sort_keys=True,
                          ensure_ascii=False, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    async def chat(self, messages: list[dict[str, Any]], prefill: str = "", max_tokens: int | None = None,
                   temperature: float | None = None) -> ChatResult:
        """The reply to `messages` (only what follows `prefill`); raises LLMError when it cannot be had."""
        max_tokens = self.max_tokens if max_tokens is None else max_tokens
        temperature = self.temperature if temperature is None else temperature
        semaphore, inflight = self._loop_state()
        key = self._key(messages, prefill, max_tokens) if self.use_cache and temperature == 0 else None
        if key is not None:
            hit = self._cache.get(key)
            if hit is not None:
                self.usage.requests += 1
                self.usage.cache_hits += 1
                return ChatResult(**{**hit, "cached": True, "attempts": 0, "seconds": 0.0})
            if key in inflight:  # the same request is on its way: share its answer
                result = await asyncio.shield(inflight[key])
                self.usage.requests += 1
                self.usage.cache_hits += 1
                return dataclasses.replace(result, cached=True, attempts=0, seconds=0.0)
            inflight[key] = asyncio.get_running_loop().create_future()
        try:
            async with semaphore:
                result = await self._attempts(messages, prefill, max_tokens, temperature)
        except BaseException as exc:
            if key is not None:
                future = inflight.pop(key)
                if isinstance(exc, Exception):
                    future.set_exception(exc)
                    future.exception()  # retrieved: waiters re-raise it, no "never retrieved" warning
                else:
                    future.cancel()
            raise
        if key is not None:
            inflight.pop(key).set_result(result)
            self._store(key, result)
        return result

    async def _attempts(self, messages: list[dict[str, Any]], prefill: str, max_tokens: int,
                        temperature: float) -> ChatResult:
        start = time.perf_counter()
        errors: list[str] = []
        for attempt in range(self.retry.retries + 1):
            try:
                result = await self.transport(messages, prefill, max_tokens, temperature)
            except Retryable as exc:
                errors.append(str(exc))
                if attempt == self.retry.retries:
                    break
                self.usage.retries += 1
                await asyncio.sleep(self.retry.delay(attempt, exc.retry_after))
                continue
            except LLMError as exc:
                self.usage.errors += 1
                self.usage.seconds += time.perf_counter() - start
                raise LLMError(f"{self.model}: {exc}") from None
            result.attempts = attempt + 1
            result.seconds = time.perf_counter() - start
            self.usage.requests += 1
            self.usage.prompt_tokens += result.prompt_tokens
            self.usage.completion_tokens += result.completion_tokens
            self.usage.seconds += result.seconds
            return result
        self.usage.errors += 1
        self.usage.seconds += time.perf_counter() - start
        tried = self.retry.retries + 1
        raise LLMError(f"{self.model}: failed after {tried} attempt(s): {errors[-1]}"
                       + (f" (first: {errors[0]})" if errors[0] != errors[-1] else ""))

    def _store(self, key: str, result: ChatResult) -> None:
        entry = {"text": result.text, "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
                 "completion_tokens": result.completion_tokens}
        self._cache[key] = entry
        if self._cache_path is not None:
            self._cache_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self._cache_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"key": key, "result": entry}, ensure_ascii=False) + "\n")

    async def close(self) -> None:
        await self.transport.close()


class OpenAITransport:
    """`POST {base_url}/chat/completions` with httpx; one connection pool per event loop."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 60.0,
                 extra_body: dict[str, Any] | None = None):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.extra_body = dict(extra_body or {})
        self._http: Any = None
        self._http_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:  # never the key
        return f"OpenAITransport({self.url!r}, model={self.model!r})"

    def _client(self) -> Any:
        import httpx
        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop:
            self._http = httpx.AsyncClient(timeout=self.timeout_s, headers=self._headers)
            self._http_loop = loop
        return self._http

    async def __call__(self, messages: list[dict[str, Any]], prefill: str, max_tokens: int,
                       temperature: float) -> ChatResult:
        import httpx
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": temperature, **self.extra_body}
        if prefill:
            body["messages"] = [*messages, {"role": "assistant", "content": prefill}]
            body.update(continue_final_message=True, add_generation_prompt=False)
        try:
            # httpx's timeout bounds each read, not the request: a server sending a byte a second would hold
            # the step for good. The whole request gets timeout_s.
            response = await asyncio.wait_for(self._client().post(self.url, json=body), self.timeout_s)
        except (httpx.TimeoutException, asyncio.TimeoutError):
            raise Retryable(f"timed out after {self.timeout_s:g}s") from None
        except httpx.TransportError as exc:  # refused, reset, DNS: the server may come back
            raise Retryable(f"{type(exc).__name__}: {exc or 'connection failed'}") from None
        if response.status_code in RETRY_STATUS:
            raise Retryable(f"HTTP {response.status_code}: {response.text[:200]}", _retry_after(response))
        if response.status_code != 200:
            raise LLMError(f"HTTP {response.status_code} from {self.url}: {response.text[:300]}")
        try:
            data = response.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] or ""
            usage = data.get("usage") or {}
        except (ValueError, KeyError, IndexError, TypeError):
            raise Retryable(f"malformed response body: {response.text[:200]!r}") from None
        return ChatResult(str(text), str(choice.get("finish_reason") or "stop"),
                          int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))

    async def close(self) -> None:
        if self._http is not None and self._http_loop is not None and not self._http_loop.is_closed():
            try:
                await self._http.aclose()
            except RuntimeError:  # closed from another loop than its own
                pass
        self._http = None


def _retry_after(response: Any) -> float | None:
    try:
        return float(response.headers.get("retry-after"))
    except (TypeError, ValueError):
        return None


class EngineTransport:
    """A local turnrl engine (a frozen copy of a model) behind the chat interface.

    `engine` is a zero-argument callable giving the engine (built on first use, maybe shared with other
    clients); the chat template renders the messages, the engine samples token ids, the reply is decoded
    without its end-of-turn token.
    """

    def __init__(self, engine: Callable[[], Any], template: Any):
        self._engine = engine
        self._built: Any = None
        self.template = template

    async def __call__(self, messages: list[dict[str, Any]], prefill: str, max_tokens: int,
                       temperature: float) -> ChatResult:
        if self._built is None:  # loading a model blocks: not on the event loop's thread
            self._built = await asyncio.to_thread(self._engine)
        engine = self._built
        ids = self.template.encode(self.template.render(messages, add_generation_prompt=True) + prefill)
        sampling = Sampling(max_tokens=max_tokens, temperature=temperature,
                            stop_token_ids=tuple(self.template.stop_token_ids))
        try:
            completion = (await resume.generate(engine, ids, sampling)).completion
        except EngineError as exc:
            raise LLMError(f"local engine: {exc}") from None
        out = completion.token_ids
        if completion.finish_reason == "stop" and out and out[-1] in self.template.stop_token_ids:
            out = out[:-1]
        return ChatResult(self.template.decode(out), completion.finish_reason, len(ids), len(completion.token_ids))

    async def close(self) -> None:
        pass  # the engine belongs to the pool that built it


def json_objects(text: str) -> Iterator[dict[str, Any]]:
    """Every JSON object embedded in a model's reply (prose, code fences around it), in order of appearance."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            obj, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            yield obj
