"""The HTTP face of the gateway: an ASGI app (FastAPI) with OpenAI's routes, per session and without one.

    GET  /v1/models                            the served model name(s)
    POST /v1/chat/completions                  chat (recorded when the X-TurnRL-Session header names a session)
    POST /v1/completions                       text completions
    POST /sessions                             open a session -> {"id", "base_url"}
    GET  /sessions/{id}                        its counters
    POST /sessions/{id}/close                  close it -> the recorded trajectory (ledger JSON)
    *    /sessions/{id}/v1/...                 the OpenAI routes inside a session: give an agent this base URL

Errors are OpenAI's shape (`requests.APIError`). A whole (not streamed) answer carries a `Server-Timing` header:
`gateway;dur=0.41, engine;dur=812.3` (milliseconds), the gateway's own time and the engine's. Each call runs next
to a watcher of the client's connection; when the client goes away first, the call is cancelled, which aborts its
engine request and undoes it in the session. Streaming (`stream: true`) with one choice sends the content as it is
sampled (`Gateway.chat_stream`; engines with `capabilities.streaming`, hf and vLLM, yield tokens as they come, the
others the whole completion at once), then the tool calls, the finish reason, the optional usage and `[DONE]`; with
`n` > 1, and for `/v1/completions`, the finished completion goes out as chunks. `tool_choice: required` or a named
function is enforced (`service.Gateway.forced_ids`): the reply continues a forced call opening, and its message and
`tool_calls` include it.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from turnrl.gateway.replies import new_id
from turnrl.gateway.requests import APIError, parse_chat, parse_completion
from turnrl.gateway.service import Answer, Gateway

SESSION_HEADER = "x-turnrl-session"

try:   # a faster JSON codec where installed (the `agents` extra has it): the same JSON, a few times sooner
    import orjson
except ImportError:   # pragma: no cover - the standard library's, then
    orjson = None


class _JSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        # orjson writes what JSONResponse writes (UTF-8, no spaces), except a non-finite float (a -inf logprob),
        # which it writes as null where JSONResponse fails the request; what it cannot write (an int past 64
        # bits, a custom type in a session's info) goes the standard library's way
        if orjson is not None:
            try:
                return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)
            except TypeError:
                pass
        return super().render(content)


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def build_app(gateway: Gateway, on_close: Callable[[Any], None] | None = None) -> FastAPI:
    """`on_close(trajectory)` runs for each session closed over HTTP (e.g. to save it)."""
    app = FastAPI(title="turnrl gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)   # nobody reads it; the call was cancelled and undone

    @app.exception_handler(404)
    async def not_found(request: Request, _: Exception) -> JSONResponse:
        return JSONResponse(APIError(404, f"Unknown route {request.method} {request.url.path}.",
                                     code="unknown_url").body(), status_code=404)

    @app.exception_handler(405)
    async def not_allowed(request: Request, _: Exception) -> JSONResponse:
        return JSONResponse(APIError(405, f"Method {request.method} is not allowed on {request.url.path}.").body(),
                            status_code=405)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "sessions": len(gateway.sessions), **gateway.stats}

    @app.get("/v1/models")
    @app.get("/sessions/{sid}/v1/models")
    async def models(sid: str | None = None) -> dict[str, Any]:
        if sid is not None:
            gateway.session(sid)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "turnrl"}
                                           for name in gateway.model_names]}

    @app.post("/sessions")
    async def open_session(request: Request) -> dict[str, Any]:
        body = await _json(request) if await request.body() else {}
        if not isinstance(body, dict):
            raise APIError(400, "The request body must be a JSON object.")
        session = gateway.open_session(str(body.get("group_id", "")), int(body.get("sample_index", 0) or 0),
                                       body.get("info") if isinstance(body.get("info"), dict) else None)
        return {"id": session.id, "base_url": f"{str(request.base_url).rstrip('/')}/sessions/{session.id}/v1"}

    @app.get("/sessions/{sid}")
    async def session_info(sid: str) -> dict[str, Any]:
        s = gateway.session(sid)
        return {"id": s.id, "calls": s.calls, "branches": len(s.branches), "breaks": list(s.breaks),
                "forks": s.forks, "aborted": s.aborted}

    @app.post("/sessions/{sid}/close")
    async def close_session(sid: str) -> JSONResponse:
        traj = gateway.close_session(sid)
        if on_close is not None:
            on_close(traj)
        # a response, not a dict: FastAPI would walk every token of the trajectory again to encode it
        return _JSONResponse(traj.to_dict())

    @app.post("/v1/chat/completions")
    @app.post("/sessions/{sid}/v1/chat/completions")
    async def chat(request: Request, sid: str | None = None) -> Response:
        start = time.perf_counter()
        req = parse_chat(await _json(request))
        session = _session(gateway, request, sid)
        if req.sampling.stream and req.sampling.n == 1:
            return await _token_stream(request, gateway, req, session)
        answer = await _watched(request, gateway.chat(req, session, defer=not req.sampling.stream))
        if req.sampling.stream:
            return _sse(_chat_chunks(gateway, answer, req.sampling.include_usage))
        return _timed(_JSONResponse(chat_body(gateway, answer, req.logprobs), background=_settle(answer)), start, answer)

    @app.post("/v1/completions")
    @app.post("/sessions/{sid}/v1/completions")
    async def completions(request: Request, sid: str | None = None) -> Response:
        start = time.perf_counter()
        req = parse_completion(await _json(request))
        session = _session(gateway, request, sid)
        answer = await _watched(request, gateway.complete(req, session))
        body = completion_body(gateway, answer, req.logprobs is not None)
        if req.sampling.stream:
            return _sse(_completion_chunks(body, req.sampling.include_usage))
        return _timed(_JSONResponse(body), start, answer)

    return app


def _settle(answer: Answer) -> BackgroundTask | None:
    """Commit the answer's replies to its session after the response is sent (`Gateway.chat`'s `defer`). A
    coroutine function, so Starlette runs it on the event loop, not in a worker thread."""
    session = answer.session
    if session is None:
        return None

    async def settle() -> None:
        session.settle()
    return BackgroundTask(settle)


def _timed(response: Response, start: float, answer: Answer) -> Response:
    """A `Server-Timing` header: the engine's share of the call and the gateway's own (reading the body,
    checks, the ledger, the reply and its JSON), in milliseconds; what the HTTP server does before and after
    the route (parsing the request line and headers, writing to the socket) is in neither."""
    total = time.perf_counter() - start
    response.headers["server-timing"] = (f"gateway;dur={(total - answer.engine_s) * 1000:.3f}, "
                                         f"engine;dur={answer.engine_s * 1000:.3f}")
    return response


def _session(gateway: Gateway, request: Request, sid: str | None) -> Any:
    sid = sid or request.headers.get(SESSION_HEADER)
    return gateway.session(sid) if sid else None


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return orjson.loads(raw) if orjson is not None else json.loads(raw)
    except ValueError as exc:
        raise APIError(400, f"We could not parse the JSON body of your request: {exc}.") from None


async def _watched(request: Request, work: Awaitable[Answer]) -> Answer:
    """Run `work`; if the client disconnects first, cancel it (aborting the engine request)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone; nobody reads the answer
        pass
    raise ClientGone()


async def _token_stream(request: Request, gateway: Gateway, req: Any, session: Any) -> Response:
    """`stream: true` with one choice: content chunks as the tokens are sampled, then the tool calls, the
    finish reason and the usage. Whatever refuses the request does so before the first chunk, as an HTTP error;
    an engine failure later is an error event. A client gone mid-stream cancels the generator, which aborts
    the engine request and undoes the call."""
    items = gateway.chat_stream(req, session)
    first = await _watched(request, items.__anext__())
    head = {"id": new_id("chatcmpl-"), "object": "chat.completion.chunk", "created": int(time.time()),
            "model": req.model, "system_fingerprint": None}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        yield chunk({"role": "assistant", "content": ""})
        item = first
        while not isinstance(item, Answer):
            yield chunk({"content": item})
            try:
                item = await items.__anext__()
            except APIError as exc:
                yield exc.body()
                return
        reply = item.replies[0]
        for j, call in enumerate(reply.message().get("tool_calls", [])):
            yield chunk({"tool_calls": [{"index": j, **call}]})
        yield chunk({}, reply.openai_finish)
        if req.sampling.include_usage:
            yield {**head, "choices": [], "usage": _usage(item)}
    return _sse(chunks(), items)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- response bodies ---------------------------------------------------------------------------------
def _token_logprobs(gateway: Gateway, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    out = []
    for tok, lp in zip(ids, logprobs):
        text = gateway.template.decode([tok])
        out.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
    return out


def _usage(answer: Answer) -> dict[str, int]:
    completion = sum(len(r.token_ids) for r in answer.replies)
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": completion,
            "total_tokens": answer.prompt_tokens + completion}


def chat_body(gateway: Gateway, answer: Answer, logprobs: bool) -> dict[str, Any]:
    choices = []
    for i, reply in enumerate(answer.replies):
        lp = {"content": _token_logprobs(gateway, reply.token_ids, reply.logprobs)} if logprobs else None
        choices.append({"index": i, "message": reply.message(), "logprobs": lp, "finish_reason": reply.openai_finish})
    return {"id": answer.id, "object": "chat.completion", "created": answer.created, "model": answer.model,
            "choices": choices, "usage": _usage(answer), "system_fingerprint": None}


def completion_body(gateway: Gateway, answer: Answer, logprobs: bool) -> dict[str, Any]:
    choices = []
    for i, reply in enumerate(answer.replies):
        lp = None
        if logprobs:
            tokens = [gateway.template.decode([t]) for t in reply.token_ids]
            offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
            lp = {"tokens": tokens, "token_logprobs": reply.logprobs,
                  "top_logprobs": [{t: v} for t, v in zip(tokens, reply.logprobs)], "text_offset": offsets}
        choices.append({"index": i, "text": reply.content or "", "logprobs": lp, "finish_reason": reply.openai_finish})
    return {"id": answer.id, "object": "text_completion", "created": answer.created, "model": answer.model,
            "choices": choices, "usage": _usage(answer)}


def _sse(chunks: AsyncIterator[dict[str, Any]], source: Any = None) -> StreamingResponse:
    """Server-sent events; `source` (an async generator the chunks come from) is closed however the stream
    ends, so a client gone mid-stream aborts what it was waiting for."""
    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            if source is not None:
                await source.aclose()
    return StreamingResponse(events(), media_type="text/event-stream")


async def _chat_chunks(gateway: Gateway, answer: Answer, usage: bool) -> AsyncIterator[dict[str, Any]]:
    head = {"id": answer.id, "object": "chat.completion.chunk", "created": answer.created, "model": answer.model,
            "system_fingerprint": None}
    for i, reply in enumerate(answer.replies):
        yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        if reply.content:
            yield {**head, "choices": [{"index": i, "delta": {"content": reply.content}, "finish_reason": None}]}
        for j, call in enumerate(reply.message().get("tool_calls", [])):
            yield {**head, "choices": [{"index": i, "delta": {"tool_calls": [{"index": j, **call}]},
                                        "finish_reason": None}]}
        yield {**head, "choices": [{"index": i, "delta": {}, "finish_reason": reply.openai_finish}]}
    if usage:
        yield {**head, "choices": [], "usage": _usage(answer)}


async def _completion_chunks(body: dict[str, Any], usage: bool) -> AsyncIterator[dict[str, Any]]:
    head = {k: body[k] for k in ("id", "object", "created", "model")}
    for choice in body["choices"]:
        yield {**head, "choices": [choice]}
    if usage:
        yield {**head, "choices": [], "usage": body["usage"]}
