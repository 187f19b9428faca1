"""Tools: a protocol with a per-trajectory lifecycle, function tools, and the per-trajectory runner.

Lifecycle (each trajectory gets its own tool instances, so no state leaks between concurrent samples):
`create(**row_kwargs)` once at the start, `execute(args)` for every call (state persists across calls),
`reward()` once at the end, `release()` always, even after errors. Only `execute` is required; a tool
without `create`, `reward` or `release` skips that step. Methods may be sync or async; sync ones run in a
worker thread so a slow tool never blocks the agent loop.

A tool's `execute` may return a `ToolOutput`, a string, a number, or verl's `(text, step_reward, metrics)`
tuple; anything else (`None` from a forgotten `return`, a list, an object) is the tool's error.
Failures are data: a tool that raises (any BaseException: `SystemExit` from an argparse CLI too) or runs past
its timeout yields an error result (blamed on the environment, which masks the trajectory out of the loss); a call with an unknown name or arguments that do
not match the schema yields an error result blamed on the policy (it stays in the loss, so the policy can
learn to call tools correctly). Either way the error text can be returned to the model.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from turnrl.env.threads import in_daemon_thread
from turnrl.ledger import ToolCall, ToolResult

JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


@dataclass
class ToolOutput:
    text: str
    reward: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Tool(Protocol):
    name: str
    schema: dict[str, Any]           # OpenAI function format: {"type": "function", "function": {...}}

    def create(self, **kwargs: Any) -> Any: ...
    def execute(self, args: dict[str, Any]) -> Any: ...
    def reward(self) -> Any: ...
    def release(self) -> Any: ...


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class Raised(Exception):
    """A user callable raised a BaseException that is not an Exception (`SystemExit` from an argparse CLI on bad
    arguments, `KeyboardInterrupt`, a custom one). Let through, asyncio re-raises it out of the event loop and the
    whole run dies; it is the callable's failure, so it becomes an ordinary exception. `original` is what it raised.
    """

    def __init__(self, original: BaseException):
        super().__init__(f"{type(original).__name__}: {original}")
        self.original = original


def _contained(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception:
        raise
    except BaseException as exc:  # noqa: BLE001 - see Raised; in a worker thread, so never our own Ctrl-C
        raise Raised(exc) from exc


async def _awaited(value: Any) -> Any:
    try:
        return await maybe_await(value)
    except (Exception, asyncio.CancelledError, GeneratorExit):
        raise  # cancellation (a timeout, shutdown) is ours, not the callable's
    except BaseException as exc:  # noqa: BLE001
        raise Raised(exc) from exc


def described(exc: BaseException) -> str:
    """'Type: message' of what a user callable raised (through `Raised`, the original)."""
    original = exc.original if isinstance(exc, Raised) else exc
    return f"{type(original).__name__}: {original}"


async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a sync or async callable without blocking the event loop; a BaseException it raises becomes `Raised`."""
    if inspect.iscoroutinefunction(fn):
        return await _awaited(fn(*args, **kwargs))
    return await _awaited(await in_daemon_thread(functools.partial(_contained, fn, *args, **kwargs)))


def _param_docs(doc: str) -> dict[str, str]:
    """Parameter descriptions from a Google-style `Args:` section."""
    out, in_args = {}, False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped.lower() in ("args:", "arguments:", "parameters:"):
            in_args = True
            continue
        if in_args:
            match = re.match(r"(\w+)\s*(\([^)]*\))?\s*:\s*(.+)", stripped)
            if match:
                out[match.group(1)] = match.group(3)
            elif stripped and not line.startswith((" ", "\t")):
                in_args = False
    return out


def schema_from_function(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """An OpenAI function schema from a Python signature and docstring."""
    doc = inspect.getdoc(fn) or ""
    descriptions = _param_docs(doc)
    hints = {k: v for k, v in getattr(fn, "__annotations__", {}).items() if k != "return"}
    props, required = {}, []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        tp = hints.get(pname, str)
        if isinstance(tp, str):  # postponed annotations
            tp = {"int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict}.get(tp, str)
        prop: dict[str, Any] = {"type": JSON_TYPES.get(getattr(tp, "__origin__", tp), "string")}
        if pname in descriptions:
            prop["description"] = descriptions[pname]
        props[pname] = prop
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    summary = doc.split("\n\n")[0].strip() if doc else (name or fn.__name__)
    return {"type": "function", "function": {
        "name": name or fn.__name__, "description": summary,
        "parameters": {"type": "object", "properties": props, "required": required}}}


class FunctionTool:
    """A stateless tool from a plain function: the schema comes from its signature and docstring."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None):
        self.fn = fn
        self.schema = schema_from_function(fn, name)
        self.name = self.schema["function"]["name"]

    def create(self, **kwargs: Any) -> None:
        return None

    async def execute(self, args: dict[str, Any]) -> Any:
        return await call(self.fn, **args)

    def reward(self) -> None:
        return None

    def release(self) -> None:
        return None


def check_arguments(schema: dict[str, Any], args: dict[str, Any]) -> str | None:
    """A message for arguments that do not fit the schema (missing/unknown keys, wrong JSON types)."""
    params = schema.get("function", schema).get("parameters", {}) or {}
    props = params.get("properties", {}) or {}
    missing = [k for k in params.get("required", []) if k not in args]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    # A schema that lists its properties (even none, as for a function without parameters) takes no others,
    # unless it says so: otherwise an extra argument would crash the tool and be blamed on the environment.
    if "properties" in params and params.get("additionalProperties", False) is False:
        unknown = [k for k in args if k not in props]
        if unknown:
            expected = ", ".join(props) or "no arguments"
            return f"unknown argument(s): {', '.join(unknown)}; expected {expected}"
    checks = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
              "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict)}
    for key, value in args.items():
        expected = props.get(key, {}).get("type")
        if isinstance(expected, str) and expected in checks and not checks[expected](value):
            return f"argument '{key}' must be of type {expected}, got {type(value).__name__}"
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")


def as_text(value: Any) -> str:
    """Text a tokenizer takes: bytes are decoded as UTF-8, and what is not valid Unicode (undecodable bytes, the
    lone surrogates of `surrogateescape`) becomes U+FFFD. Fast tokenizers raise on lone surrogates."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    text = value if isinstance(value, str) else str(value)
    return _SURROGATE.sub("\ufffd", text)


def finite_reward(value: Any, what: str) -> float:
    """A reward as a float; NaN or infinity would poison every advantage of the batch, so they are errors."""
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"{what} must be a finite number, got {reward}")
    return reward


def _normalize(output: Any) -> ToolOutput:
    """Any accepted return value -> ToolOutput; TypeError/ValueError for a reward that is not a finite number."""
    if isinstance(output, ToolOutput):
        reward = None if output.reward is None else finite_reward(output.reward, "the step reward")
        return ToolOutput(as_text(output.text), reward, output.metrics)
    if isinstance(output, tuple) and 1 <= len(output) <= 3:  # verl: (text, step_reward, metrics)
        text = output[0]
        reward = output[1] if len(output) > 1 else None
        metrics = output[2] if len(output) > 2 else {}
        if isinstance(text, dict):  # verl's ToolResponse-like {"text": ...}
            text = text.get("text", "")
        elif not isinstance(text, (str, bytes)) and hasattr(text, "text"):  # verl's ToolResponse object
            text = text.text or ""
        return ToolOutput(as_text(text), None if reward is None else finite_reward(reward, "the step reward"),
                          dict(metrics or {}))
    if isinstance(output, (str, bytes, bytearray)):
        return ToolOutput(as_text(output))
    if isinstance(output, (int, float)) and not isinstance(output, bool):   # `def add(a, b): return a + b`
        return ToolOutput(str(output))
    text = getattr(output, "text", None)   # verl's ToolResponse and its look-alikes
    if isinstance(text, (str, bytes, bytearray)):
        return ToolOutput(as_text(text))
    # None (a forgotten `return`) or any other object would reach the model as "None" or a repr, and count as a
    # successful call: the tool is broken, so it is the tool's error.
    raise TypeError(f"a tool must return text (a str, a number, a ToolOutput or verl's (text, reward, "
                    f"metrics)), got {type(output).__name__}")


class ToolSession:
    """One trajectory's tool instances, created once and released once."""

    def __init__(self, tools: dict[str, Tool], row_kwargs: dict[str, dict[str, Any]] | None = None,
                 timeout_s: float = 10.0, max_parallel: int = 4,
                 truncate: Callable[[str], tuple[str, bool]] | None = None):
        self.tools = tools
        self.row_kwargs = row_kwargs or {}
        self.timeout_s = timeout_s
        self.semaphore = asyncio.Semaphore(max_parallel)
        self.truncate = truncate or (lambda text: (text, False))
        self.create_errors: dict[str, str] = {}

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    async def create(self) -> None:
        for name, tool in self.tools.items():
            create = getattr(tool, "create", None)  # the lifecycle methods are optional
            if create is None:
                if self.row_kwargs.get(name):
                    self.create_errors[name] = "the row gives create kwargs but the tool has no create()"
                continue
            try:
                await asyncio.wait_for(call(create, **self.row_kwargs.get(name, {})), self.timeout_s)
            except asyncio.TimeoutError:
                self.create_errors[name] = f"create() timed out after {self.timeout_s:g}s"
            except Exception as exc:  # noqa: BLE001 - recorded, the tool then answers with the error
                self.create_errors[name] = described(exc)

    async def execute_all(self, calls: list[ToolCall]) -> list[ToolResult]:
        return list(await asyncio.gather(*(self._execute(c) for c in calls)))

    async def _execute(self, tc: ToolCall) -> ToolResult:
        if tc.error:
            return ToolResult(tc.name, f"Error: {tc.error}", tc.id, error=tc.error, blame="policy", kind="tool_parse")
        tool = self.tools.get(tc.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            msg = f"unknown tool '{tc.name}'; available tools: {known}"
            return ToolResult(tc.name, f"Error: {msg}", tc.id, error=msg, blame="policy", kind="tool_parse")
        bad = check_arguments(tool.schema, tc.arguments or {})
        if bad:
            return ToolResult(tc.name, f"Error: {bad}", tc.id, error=bad, blame="policy", kind="tool_parse")
        if tc.name in self.create_errors:
            msg = f"tool failed to start: {self.create_errors[tc.name]}"
            return ToolResult(tc.name, f"Error: {msg}", tc.id, error=msg, blame="environment")
        start = time.perf_counter()
        async with self.semaphore:
            try:
                raw = await asyncio.wait_for(call(tool.execute, tc.arguments or {}), self.timeout_s)
            except asyncio.TimeoutError:
                msg = f"tool '{tc.name}' timed out after {self.timeout_s:g}s"
                return ToolResult(tc.name, f"Error: {msg}", tc.id, error=msg, blame="environment",
                                  kind="tool_timeout",
                                  seconds=time.perf_counter() - start)
            except Exception as exc:  # noqa: BLE001 - a crashing tool is data, not a crash
                msg = f"tool '{tc.name}' raised {described(exc)}"
                text, truncated = await self._truncate(f"Error: {msg}")  # an exception's text can be huge too
                return ToolResult(tc.name, text, tc.id, error=msg, blame="environment", truncated=truncated,
                                  seconds=time.perf_counter() - start)
        try:
            out = _normalize(raw)
        except (TypeError, ValueError) as exc:
            msg = f"tool '{tc.name}' returned an unusable result: {exc}"
            return ToolResult(tc.name, f"Error: {msg}", tc.id, error=msg, blame="environment",
                              seconds=time.perf_counter() - start)
        text, truncated = await self._truncate(out.text)
        return ToolResult(tc.name, text, tc.id, reward=out.reward, metrics=out.metrics, truncated=truncated,
                          seconds=time.perf_counter() - start)

    async def _truncate(self, text: str) -> tuple[str, bool]:
        if len(text) < 10_000:
            return self.truncate(text)
        # Tokenizing a megabyte takes most of a second: off the event loop, so that the other trajectories
        # (and their tools' timeouts) are not held up.
        return await call(self.truncate, text)

    async def rewards(self) -> tuple[dict[str, float], list[str]]:
        out, errors = {}, []
        for name, tool in self.tools.items():
            if getattr(tool, "reward", None) is None:
                continue
            try:
                value = await asyncio.wait_for(call(tool.reward), self.timeout_s)
                if value is not None:  # inside the try: a reward that is not a finite number is an error too
                    out[name] = finite_reward(value, "the final reward")
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{name}.reward() failed: {described(exc)}")
        return out, errors

    async def release(self) -> list[str]:
        errors = []
        for name, tool in self.tools.items():
            if getattr(tool, "release", None) is None:
                continue
            try:
                await asyncio.wait_for(call(tool.release), self.timeout_s)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{name}.release() failed: {described(exc)}")
        return errors
