"""Run the gateway's ASGI app with uvicorn: inside a running event loop (trainer, tests) or as `turnrl serve`.

`running(app)` starts uvicorn on the caller's loop (port 0: a free port) and yields the base URL, so an agent
coroutine, the gateway and the engine's callbacks share one loop: no threads, no copies. Binding to anything
but a loopback address needs `allow_remote`, since whoever reaches the port can sample from the policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import socket
import ssl
from typing import Any, AsyncIterator


NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]   # for clients: see `running`


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for every client below. httpx builds a new one per client by default, loading the CA
    bundle each time: 53 ms of the event loop per agent session, measured here (the gateway is plain HTTP on
    loopback, so the context is never used; it stays a verifying one for a client that calls out over TLS)."""
    return ssl.create_default_context()


def async_client(timeout: float) -> Any:
    """An httpx client for one agent session: TCP_NODELAY, the shared TLS context."""
    import httpx
    ctx = tls_context()
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(socket_options=NODELAY, verify=ctx), verify=ctx,
                             timeout=timeout)


def sync_client(timeout: float) -> Any:
    """`async_client` for agents written as plain functions."""
    import httpx
    ctx = tls_context()
    return httpx.Client(transport=httpx.HTTPTransport(socket_options=NODELAY, verify=ctx), verify=ctx, timeout=timeout)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_host(host: str, allow_remote: bool) -> None:
    if not is_loopback(host) and not allow_remote:
        raise ValueError(f"refusing to listen on {host}: anyone who reaches it can sample from the model and write "
                         "into sessions whose ids they learn. Use 127.0.0.1, or pass --allow-remote.")


def _config(app: Any, host: str, port: int) -> Any:
    import uvicorn
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                          timeout_keep_alive=30, backlog=4096)


@contextlib.asynccontextmanager
async def running(app: Any, host: str = "127.0.0.1", port: int = 0, allow_remote: bool = False
                  ) -> AsyncIterator[str]:
    """Serve `app` on this loop while the block runs; yields 'http://host:port'."""
    import uvicorn
    check_host(host, allow_remote)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this: without it a response written in two pieces (headers, body) waits for
    # the client's delayed ACK (~40 ms on Linux) before its second piece goes out.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    server = uvicorn.Server(_config(app, host, sock.getsockname()[1]))
    server.capture_signals = contextlib.nullcontext   # the caller owns the process's signals
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()   # raises what stopped it
        await asyncio.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


async def serve_until_stopped(app: Any, host: str, port: int, allow_remote: bool) -> None:
    """`turnrl serve`: uvicorn on this loop until Ctrl-C / SIGTERM."""
    import uvicorn
    check_host(host, allow_remote)
    await uvicorn.Server(_config(app, host, port)).serve()
