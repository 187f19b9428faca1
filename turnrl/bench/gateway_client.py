"""The overhead part of `turnrl bench gateway` from an agent's side: a client in its own process.

`python -m turnrl.bench.gateway_client URL SESSIONS TURNS` opens SESSIONS sessions over HTTP, makes TURNS chat
calls in each (the conversation so far plus a new user message, as in `bench.gateway._through_gateway`), closes
them, and prints one JSON object: every call's round trip in seconds and the wall time of all of them. In its
own process the client's JSON and HTTP work runs beside the server instead of between its steps, as it does
for an agent in another process.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any


async def measure(url: str, sessions: int, turns: int) -> dict[str, Any]:
    import httpx

    from turnrl.gateway.server import NODELAY
    out: list[float] = []
    limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
    transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=NODELAY)
    async with httpx.AsyncClient(transport=transport, timeout=600) as http:
        async def one() -> None:
            sid = (await http.post(f"{url}/sessions", json={})).raise_for_status().json()["id"]
            messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6 * 7?"}]
            for k in range(turns):
                t0 = time.perf_counter()
                r = await http.post(f"{url}/sessions/{sid}/v1/chat/completions",
                                    json={"model": "bench", "messages": messages, "max_tokens": 32})
                out.append(time.perf_counter() - t0)
                r.raise_for_status()
                messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"And step {k}?"}]
            (await http.post(f"{url}/sessions/{sid}/close")).raise_for_status()
        await one()   # warm-up: the connection, first imports on both sides
        out.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(sessions)))
        seconds = time.perf_counter() - t0
    return {"latencies_s": out, "seconds": seconds}


def main(argv: list[str]) -> int:
    url, sessions, turns = argv[0], int(argv[1]), int(argv[2])
    print(json.dumps(asyncio.run(measure(url, sessions, turns))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
