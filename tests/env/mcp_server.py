"""A real MCP server written with the SDK, for the MCP tool tests: `python mcp_server.py stdio` or
`python mcp_server.py http PORT` (streamable HTTP at http://127.0.0.1:PORT/mcp).

Tools: add (stateless), count (the number of count calls in this MCP session: state per session), pid
(which server process answers), fail (answers with isError), crash (the process exits mid-call), hang
(never answers). Works with mcp 1.x (FastMCP) and 2.x (MCPServer).
"""

import asyncio
import os
import sys

try:
    from mcp.server.mcpserver import Context, MCPServer
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import Context, FastMCP as MCPServer

server = MCPServer("turnrl-test", log_level="WARNING")
COUNTS: dict[str, int] = {}


def session_key(ctx: Context) -> str:
    """The MCP session of a request: its Mcp-Session-Id over HTTP; over stdio the process is the session."""
    request = getattr(ctx.request_context, "request", None)
    headers = getattr(request, "headers", None) or {}
    return headers.get("mcp-session-id") or "stdio"


@server.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@server.tool()
def count(ctx: Context) -> str:
    """How many times count was called in this session."""
    key = session_key(ctx)
    COUNTS[key] = COUNTS.get(key, 0) + 1
    return str(COUNTS[key])


@server.tool()
def pid() -> str:
    """The server's process id."""
    return str(os.getpid())


@server.tool()
def fail(reason: str) -> str:
    """Always fails with the given reason."""
    raise ValueError(reason)


@server.tool()
def crash() -> str:
    """Kills the server process."""
    os._exit(3)


@server.tool()
async def hang() -> str:
    """Never returns."""
    await asyncio.sleep(3600)
    return "late"


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run()
    else:
        import uvicorn
        uvicorn.run(server.streamable_http_app(), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
