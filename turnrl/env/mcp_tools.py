"""MCP servers as tools: `rollout.tools: [{class_name: mcp, config: {command: [...]} | {url: ...}}]`.

At config time the server is started once (stdio: `command`; streamable HTTP: `url`), its tools are listed with
`tools/list` (all pages), and each becomes a turnrl tool whose schema is the MCP `inputSchema` as an OpenAI
function (JSON-schema `title` noise dropped). The tools then go through the Tool lifecycle like any other:

- `session: trajectory` (default): the first tool of a server to be created for a trajectory opens an MCP
  session (stdio: a fresh server process), the server's other tools in that trajectory share it, so server
  state carries across calls; the first release closes it. A crashed server therefore never outlives its
  trajectory: the next one starts a new process.
- `session: shared`: one session for every trajectory, opened at the first create; one that died (crash,
  closed stream, a call cancelled by the tool timeout) is reopened at the next create.

Failures follow the rules of built-in tools: a server that cannot start fails `create()` (recorded, every
call then answers with the error), a call that raises (server crash, closed stream) or returns `isError`
raises here, and a hang runs into `rollout.tool_timeout_s`; all are blamed on the environment and mask the
trajectory. The SDK's transports are anyio context managers that must be entered and left by one task, while
the loop calls create and release from different ones (`asyncio.wait_for` wraps each call in a task), so each
connection is owned by a background task of its own that holds the contexts open until it is told to close.

Which trajectory a tool instance belongs to is not passed to factories; the instances of one trajectory are
made by one synchronous `_tools_for` call in that trajectory's task, so the current task identifies it.
Spec: https://modelcontextprotocol.io/specification (tools, transports). Works with mcp 1.24+ and 2.x.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import tempfile
import weakref
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.stdio import get_default_environment
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.types import PaginatedRequestParams

from turnrl.config.loader import ConfigError, build
from turnrl.config.secrets import resolve_secret


@dataclass
class MCPServerConfig:
    """`config:` of a `class_name: mcp` tool entry."""
    command: list[str] | None = None     # stdio: the server's command line, e.g. [python, server.py]
    url: str | None = None               # streamable HTTP: the endpoint, e.g. http://127.0.0.1:8000/mcp
    env: dict[str, str] = field(default_factory=dict)      # stdio: extra environment variables
    cwd: str | None = None               # stdio: working directory
    headers: dict[str, str] = field(default_factory=dict)  # http: extra headers; a value may be env:NAME/file:PATH
    session: Literal["trajectory", "shared"] = "trajectory"
    tools: list[str] | None = None       # expose only these of the server's tools (default: all)
    prefix: str = ""                     # prepended to every tool name (two servers with the same names)
    connect_timeout_s: float = 30.0      # starting the server and listing its tools at config time

    def validate(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ConfigError("an mcp tool needs exactly one of 'command' (a stdio server's command line, e.g. "
                              "[python, server.py]) or 'url' (a streamable HTTP endpoint, e.g. "
                              "http://127.0.0.1:8000/mcp).")
        if self.command is not None and (not self.command or not all(isinstance(c, str) for c in self.command)):
            raise ConfigError(f"'command' must be a non-empty list of strings, got {self.command!r}.")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"'url' must start with http:// or https://, got {self.url!r}.")
        if self.command is None and (self.env or self.cwd):
            raise ConfigError("'env' and 'cwd' are for stdio servers ('command'); an HTTP server runs elsewhere.")
        if self.url is None and self.headers:
            raise ConfigError("'headers' are for HTTP servers ('url').")
        if self.connect_timeout_s <= 0:
            raise ConfigError(f"'connect_timeout_s' must be > 0, got {self.connect_timeout_s}.")

    @property
    def where(self) -> str:
        return self.url or " ".join(self.command or [])


class MCPToolError(RuntimeError):
    """A call the server answered with isError, or that its connection could not carry."""


def openai_schema(tool: Any, name: str) -> dict[str, Any]:
    """An MCP tool (name, description, inputSchema) as an OpenAI function schema."""
    schema = _get(tool, "input_schema", "inputSchema") or {"type": "object", "properties": {}}
    params = _strip_titles(copy.deepcopy(schema))
    params.setdefault("type", "object")
    params.setdefault("properties", {})
    return {"type": "function", "function": {"name": name, "description": tool.description or tool.title or name,
                                             "parameters": params}}


def _get(obj: Any, snake: str, camel: str) -> Any:
    """A field of an SDK record: mcp 2.x names them in snake_case, 1.x as on the wire (camelCase)."""
    return getattr(obj, snake, getattr(obj, camel, None))


def _strip_titles(schema: Any) -> Any:
    """Drop `title` and `$schema` from schema objects (servers generate them from class names: prompt tokens
    that say nothing); a *property* named title stays."""
    if isinstance(schema, list):
        return [_strip_titles(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("title", "$schema") and not isinstance(value, dict):
            continue
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {k: _strip_titles(v) for k, v in value.items()}
        else:
            out[key] = _strip_titles(value)
    return out


def result_text(result: Any) -> str:
    """The text a model sees for a CallToolResult: text parts joined; other parts named, not dropped silently."""
    parts = []
    for block in result.content or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource":
            res = block.resource
            parts.append(getattr(res, "text", None) or f"[resource {res.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource {block.uri}]")
        else:
            parts.append(f"[{kind} {_get(block, 'mime_type', 'mimeType') or ''}]".replace(" ]", "]"))
    structured = _get(result, "structured_content", "structuredContent")
    if not parts and structured is not None:
        parts.append(json.dumps(structured))
    return "\n".join(parts)


class Connection:
    """One MCP client session, owned by a background task that enters and leaves the transport contexts."""

    def __init__(self, cfg: MCPServerConfig):
        self.cfg = cfg
        self.session: ClientSession | None = None
        self.error: str | None = None
        self.broken = False                     # a call failed or was cancelled: the server is suspect
        self.loop = asyncio.get_running_loop()
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._close = asyncio.Event()

    @property
    def alive(self) -> bool:
        return (self.session is not None and not self.broken and self._task is not None and not self._task.done()
                and self.loop is asyncio.get_running_loop())

    async def open(self) -> None:
        self._task = asyncio.create_task(self._own(), name=f"mcp:{self.cfg.where}")
        await self._ready.wait()
        if self.error:
            raise MCPToolError(self.error)

    async def _own(self) -> None:
        stderr = tempfile.TemporaryFile("w+", errors="replace") if self.cfg.command else None
        try:
            async with AsyncExitStack() as stack:
                streams = await stack.enter_async_context(self._transport(stderr))
                self.session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await self.session.initialize()
                self._ready.set()
                await self._close.wait()
        except BaseException as exc:  # noqa: BLE001 - told to whoever waits for the start
            if not self._ready.is_set():
                self.error = f"cannot start MCP server {self.cfg.where}: {_describe(exc)}{_tail(stderr)}"
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self.session = None
            self._ready.set()
            if stderr is not None:
                stderr.close()

    def _transport(self, stderr: Any) -> Any:
        cfg = self.cfg
        if cfg.command is not None:
            # The SDK starts servers with a small safe environment (PATH, HOME, ...), not ours, so our API keys
            # do not leak into them; `env` adds to it.
            env = {**get_default_environment(), **cfg.env} if cfg.env else None
            params = StdioServerParameters(command=cfg.command[0], args=list(cfg.command[1:]), env=env, cwd=cfg.cwd)
            return stdio_client(params, errlog=stderr)
        headers = {k: _header(k, v) for k, v in cfg.headers.items()}
        return _HTTPWithHeaders(cfg.url, headers) if headers else streamable_http_client(cfg.url)

    async def list_tools(self) -> list[Any]:
        tools, cursor = [], None
        while True:
            page = await (self.session.list_tools() if cursor is None else
                          self.session.list_tools(params=PaginatedRequestParams(cursor=cursor)))
            tools.extend(page.tools)
            cursor = _get(page, "next_cursor", "nextCursor")
            if not cursor:
                return tools

    async def call(self, name: str, args: dict[str, Any]) -> str:
        if not self.alive:
            raise MCPToolError(f"the MCP server {self.cfg.where} is not running (it crashed or was closed)")
        try:
            result = await self.session.call_tool(name, args)
        except asyncio.CancelledError:  # the tool timeout: the server may hang; a shared session is reopened
            self.broken = True
            raise
        except Exception as exc:  # noqa: BLE001 - a closed stream (crash), a protocol error
            self.broken = True
            raise MCPToolError(f"MCP server {self.cfg.where}: {_describe(exc)}") from None
        text = result_text(result)
        if _get(result, "is_error", "isError"):
            raise MCPToolError(f"the MCP tool answered with an error: {text}")
        return text

    async def close(self) -> None:
        self._close.set()
        if self._task is None or self._task.done() or self.loop is not asyncio.get_running_loop():
            return
        try:  # the SDK waits a moment for a stdio server to exit before it terminates it
            await asyncio.wait_for(asyncio.shield(self._task), 10)
        except asyncio.TimeoutError:  # a transport that will not close: cancelling its owner tears it down
            self._task.cancel()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _describe(exc.exceptions[0])
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _tail(stderr: Any, chars: int = 800) -> str:
    if stderr is None:
        return ""
    try:
        stderr.flush()
        stderr.seek(0)
        text = stderr.read().strip()
    except (OSError, ValueError):
        return ""
    return f"; its stderr ends: {text[-chars:]}" if text else ""


def _header(key: str, value: str) -> str:
    if value.startswith(("env:", "file:")):
        return resolve_secret(value, f"headers.{key}") or ""
    return value


class _HTTPWithHeaders:
    """streamable_http_client over an HTTP client that sends `headers` (mcp 2.x: httpx2, 1.x: httpx)."""

    def __init__(self, url: str, headers: dict[str, str]):
        self.url, self.headers = url, headers

    async def __aenter__(self) -> Any:
        self._stack = AsyncExitStack()
        client = await self._stack.enter_async_context(create_mcp_http_client(headers=self.headers))
        return await self._stack.enter_async_context(streamable_http_client(self.url, http_client=client))

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._stack.__aexit__(*exc)


class _TrajectoryHolder:
    """A trajectory's connection: opened by the first create() of the server's tools, closed by the first
    release() (the loop releases only after every call and reward of the trajectory)."""

    def __init__(self, cfg: MCPServerConfig):
        self.cfg = cfg
        self.started = False
        self.conn: Connection | None = None
        self.lock = asyncio.Lock()

    async def get(self) -> Connection:
        self.started = True
        async with self.lock:
            if self.conn is None:
                self.conn = Connection(self.cfg)
                await self.conn.open()
            elif self.conn.error:
                raise MCPToolError(self.conn.error)
            return self.conn

    async def close(self) -> None:
        self.started = True
        if self.conn is not None:
            conn, self.conn = self.conn, None
            await conn.close()


class _SharedHolder:
    """One connection for every trajectory; reopened by the next create() once it died."""

    def __init__(self, cfg: MCPServerConfig):
        self.cfg = cfg
        self.conn: Connection | None = None
        self.lock: asyncio.Lock | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def get(self) -> Connection:
        if self.loop is not asyncio.get_running_loop():  # a new event loop (e.g. the next asyncio.run)
            self.lock, self.loop = asyncio.Lock(), asyncio.get_running_loop()
        async with self.lock:
            if self.conn is None or not self.conn.alive:
                if self.conn is not None:
                    await self.conn.close()
                conn = Connection(self.cfg)
                await conn.open()
                self.conn = conn
            return self.conn

    async def close(self) -> None:
        return None   # it outlives trajectories; its owner task ends with the event loop


class MCPServer:
    """A configured server: its tools (listed once) and the connections trajectories use."""

    def __init__(self, cfg: MCPServerConfig):
        self.cfg = cfg
        self.tools: list[Any] = []
        self.shared = _SharedHolder(cfg)
        self._by_task: weakref.WeakKeyDictionary[asyncio.Task, _TrajectoryHolder] = weakref.WeakKeyDictionary()

    def discover(self) -> None:
        """List the server's tools, in a thread of its own (config loading may run inside an event loop)."""
        async def listing() -> list[Any]:
            conn = Connection(self.cfg)
            try:
                await asyncio.wait_for(conn.open(), self.cfg.connect_timeout_s)
                return await asyncio.wait_for(conn.list_tools(), self.cfg.connect_timeout_s)
            finally:
                await conn.close()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            try:
                tools = pool.submit(asyncio.run, listing()).result()
            except asyncio.TimeoutError:
                raise ConfigError(f"MCP server {self.cfg.where} did not start and list its tools within "
                                  f"{self.cfg.connect_timeout_s:g}s (raise connect_timeout_s?).") from None
            except Exception as exc:  # noqa: BLE001
                raise ConfigError(f"{_describe(exc)}. Check that the command runs (or the URL answers) and "
                                  "speaks MCP.") from None
        by_name = {t.name: t for t in tools}
        if self.cfg.tools is not None:
            missing = [n for n in self.cfg.tools if n not in by_name]
            if missing:
                raise ConfigError(f"MCP server {self.cfg.where} has no tool(s) {missing}; it has {sorted(by_name)}.")
            tools = [by_name[n] for n in self.cfg.tools]
        if not tools:
            raise ConfigError(f"MCP server {self.cfg.where} lists no tools.")
        self.tools = tools

    def holder_for_new_tool(self) -> _TrajectoryHolder | _SharedHolder:
        """The connection holder of a tool instance made now: the trajectory's (see the module doc), or the
        shared one."""
        if self.cfg.session == "shared":
            return self.shared
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no event loop: nothing to share with
            task = None
        holder = self._by_task.get(task) if task is not None else None
        if holder is None or holder.started:
            holder = _TrajectoryHolder(self.cfg)
            if task is not None:
                self._by_task[task] = holder
        return holder


class MCPTool:
    """One tool of an MCP server, for one trajectory."""

    def __init__(self, server: MCPServer, tool: Any):
        self.remote_name = tool.name
        self.name = server.cfg.prefix + tool.name
        self.schema = openai_schema(tool, self.name)
        self.holder = server.holder_for_new_tool()
        self.conn: Connection | None = None

    async def create(self, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"an MCP tool takes no create kwargs from the row, got {sorted(kwargs)}")
        self.conn = await self.holder.get()

    async def execute(self, args: dict[str, Any]) -> str:
        if self.conn is None:
            self.conn = await self.holder.get()
        return await self.conn.call(self.remote_name, args)

    def reward(self) -> None:
        return None

    async def release(self) -> None:
        await self.holder.close()


def mcp_tool_factories(config: dict[str, Any], where: str = "tools[mcp]") -> list[tuple[str, Callable[[], MCPTool]]]:
    """(name, factory) for every tool the configured server lists."""
    cfg = build(MCPServerConfig, config, prefix=f"{where}.config")
    server = MCPServer(cfg)
    server.discover()
    return [(server.cfg.prefix + t.name, (lambda t=t: MCPTool(server, t))) for t in server.tools]
