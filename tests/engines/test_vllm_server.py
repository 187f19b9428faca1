"""How `VLLMServer` reads a server's failures, against a small HTTP peer on loopback that answers as vLLM 0.32
does (measured here: a server whose engine process is killed answers every request in flight with HTTP 500
"EngineCore encountered an issue", and its `/health` with 503 until it exits).

- 500 while `/health` is 200: the request's own failure, an `EngineError` (no revival, no retry elsewhere);
- 500 while `/health` is 503 or the server is gone: `ServerDown`, so the pool revives and re-syncs it;
- any status above 500, or a refused connection: `ServerDown`.
"""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from turnrl.engines.base import EngineError, Sampling
from turnrl.engines.vllm_launch import free_port
from turnrl.engines.vllm_server import ServerDown, VLLMServer

DEAD_ENGINE = {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                         "type": "InternalServerError", "param": None, "code": 500}}


class Peer:
    """`/health` answers `health`; `/inference/v1/generate` answers `generate` (status, JSON body)."""

    def __init__(self, health: int, generate: tuple[int, dict]):
        self.health, self.generate, self.health_calls = health, generate, 0
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: dict | None = None):
                data = json.dumps(body).encode() if body is not None else b""
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    peer.health_calls += 1
                    self._answer(peer.health)
                else:
                    self._answer(404, {"error": "no route"})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._answer(*peer.generate)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def peer_factory():
    peers = []

    def make(health, generate):
        peers.append(Peer(health, generate))
        return peers[-1]
    yield make
    for p in peers:
        p.close()


async def _generate(url: str):
    server = VLLMServer(url, timeout_s=10.0)
    try:
        return await server.generate([1, 2, 3], Sampling(max_tokens=4, temperature=1.0))
    finally:
        await server.close()


def test_a_500_from_a_server_whose_engine_died_is_a_server_down(peer_factory):
    peer = peer_factory(503, (500, DEAD_ENGINE))
    with pytest.raises(ServerDown, match="HTTP 500.*engine is down.*EngineCore"):
        asyncio.run(_generate(peer.url))
    assert peer.health_calls == 1


def test_a_500_from_a_healthy_server_is_the_request_s_own_error(peer_factory):
    peer = peer_factory(200, (500, {"error": {"message": "bad sampling params", "code": 500}}))
    with pytest.raises(EngineError, match="refused /inference/v1/generate: HTTP 500.*bad sampling") as info:
        asyncio.run(_generate(peer.url))
    assert not isinstance(info.value, ServerDown)
    assert peer.health_calls == 1


def test_statuses_above_500_and_refused_connections_are_server_down(peer_factory):
    peer = peer_factory(200, (503, {"error": "overloaded"}))
    with pytest.raises(ServerDown, match="HTTP 503"):
        asyncio.run(_generate(peer.url))
    with pytest.raises(ServerDown, match="unreachable"):
        asyncio.run(_generate(f"http://127.0.0.1:{free_port()}"))


def test_a_client_error_is_not_a_death_and_asks_no_health(peer_factory):
    peer = peer_factory(200, (400, {"error": {"message": "prompt too long"}}))
    with pytest.raises(EngineError, match="HTTP 400.*prompt too long") as info:
        asyncio.run(_generate(peer.url))
    assert not isinstance(info.value, ServerDown) and peer.health_calls == 0
