"""The overhead part of `turnrl bench gateway` from an agent's side: a client in its own process.

`python -m turnrl.bench.gateway_client URL SESSIONS TURNS [httpx|aiohttp]` opens SESSIONS sessions over HTTP, makes
TURNS chat calls in each (the conversation so far plus a new user message), closes them, and prints one JSON
object: every call's round trip in seconds, the wall time of all of them, and per call the gateway's own time and
the engine's in milliseconds (the `Server-Timing` header; a server without it: no gateway time, engine time 0). In
its own process the client's JSON and HTTP work runs beside the server instead of between its steps, as it does for
an agent in another process.

Clients: httpx, the `openai` SDK's default transport, one client per session as turnrl gives each entry-point
agent (one httpx pool shared by 256 sessions made 27 calls/s here against a server answering after about 1 s:
its cost per call grows with the connections it holds); aiohttp, the transport the SDK offers for many
concurrent requests (`openai.DefaultAioHttpClient`), one pool for all sessions.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any, Awaitable, Callable

Post = Callable[[str, dict[str, Any]], Awaitable[tuple[dict[str, Any], str]]]   # -> (JSON body, Server-Timing)


def _timing(header: str) -> dict[str, float]:
    """'gateway;dur=0.41, engine;dur=812.3' -> {'gateway': 0.41, 'engine': 812.3}"""
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur)
    return out


async def _session_calls(post: Post, url: str, turns: int, out: list[float], server: dict[str, list[float]]) -> None:
    sid = (await post(f"{url}/sessions", {}))[0]["id"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6 * 7?"}]
    for k in range(turns):
        t0 = time.perf_counter()
        body, timing = await post(f"{url}/sessions/{sid}/v1/chat/completions",
                                  {"model": "bench", "messages": messages, "max_tokens": 32})
        out.append(time.perf_counter() - t0)
        for name, ms in _timing(timing).items():
            server.setdefault(name, []).append(ms)
        messages += [body["choices"][0]["message"], {"role": "user", "content": f"And step {k}?"}]
    await post(f"{url}/sessions/{sid}/close", {})


Runner = Callable[[Callable[[Post], Awaitable[None]]], Awaitable[None]]   # runs a session's calls with its client


async def _run(run_one: Runner, url: str, sessions: int, turns: int) -> dict[str, Any]:
    out: list[float] = []
    server: dict[str, list[float]] = {}
    calls = lambda post: _session_calls(post, url, turns, out, server)  # noqa: E731
    await run_one(calls)   # warm-up: the connection, first imports on both sides
    out.clear()
    server.clear()
    t0 = time.perf_counter()
    await asyncio.gather(*(run_one(calls) for _ in range(sessions)))
    return {"latencies_s": out, "seconds": time.perf_counter() - t0, "gateway_ms": server.get("gateway", []),
            "engine_ms": server.get("engine", [0.0] * len(out))}


async def measure(url: str, sessions: int, turns: int, client: str = "httpx") -> dict[str, Any]:
    if client == "aiohttp":
        import aiohttp
        connector = aiohttp.TCPConnector(limit=sessions + 1)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
            async def post_aiohttp(where: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
                async with http.post(where, json=body) as r:
                    r.raise_for_status()
                    return await r.json(), r.headers.get("server-timing", "")

            async def run_one(calls: Callable[[Post], Awaitable[None]]) -> None:
                await calls(post_aiohttp)
            return await _run(run_one, url, sessions, turns)
    if client != "httpx":
        raise ValueError(f"client must be httpx or aiohttp, got {client!r}")
    from turnrl.gateway.server import async_client
    # One client (one connection) per session, as turnrl gives each entry-point agent: one pool shared by
    # hundreds of sessions costs httpx more per call the more connections it holds.
    clients = [async_client(600) for _ in range(sessions + 1)]
    free = list(clients)

    try:
        async def run_one(calls: Callable[[Post], Awaitable[None]]) -> None:
            http = free.pop()

            async def post_httpx(where: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
                r = (await http.post(where, json=body)).raise_for_status()
                return r.json(), r.headers.get("server-timing", "")
            await calls(post_httpx)
        return await _run(run_one, url, sessions, turns)
    finally:
        for http in clients:
            await http.aclose()


def main(argv: list[str]) -> int:
    url, sessions, turns = argv[0], int(argv[1]), int(argv[2])
    print(json.dumps(asyncio.run(measure(url, sessions, turns, argv[3] if len(argv) > 3 else "httpx"))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
