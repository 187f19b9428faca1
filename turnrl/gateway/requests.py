"""OpenAI request bodies -> typed, validated requests; every error names the field, as OpenAI's do.

`parse_chat` and `parse_completion` check a JSON body against the parts of the Chat Completions and
Completions APIs the gateway serves and return a `ChatRequest` / `CompletionRequest`. A bad value raises
`APIError(400, message, param="messages[2].content")`; an unknown top-level field is an error too (OpenAI
answers "Unrecognized request argument supplied"), except the fields in `IGNORED`, which only steer OpenAI's
own service (storage, metadata, tiers) and change nothing about sampling.

Message contents may be strings or lists of text parts (joined); other part types (images, audio) are
refused. `developer` messages are system messages. `tool_choice` names a function in `tools` or is `auto`,
`none` or `required`; whether the parser can enforce it is the gateway's check (`Gateway.forced_ids`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options", "prompt_cache_key",
           "safety_identifier", "reasoning_effort")
MAX_N = 16
MAX_STOP = 4


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Message:
    """One chat message as the agent sent it, normalized for comparison (hashable, order-free JSON)."""
    role: str                                  # system | user | assistant | tool (developer -> system)
    content: str
    name: str = ""
    tool_call_id: str = ""
    tool_calls: tuple[tuple[str, str, str], ...] = ()   # (id, name, arguments as canonical JSON or raw text)

    def same(self, other: "Message") -> bool:
        """Equal up to tool-call ids (frameworks re-number them) and JSON whitespace/key order."""
        return (self.role == other.role and self.content == other.content and self.name == other.name
                and [c[1:] for c in self.tool_calls] == [c[1:] for c in other.tool_calls])


@dataclass
class Sampled:
    """The sampling fields shared by both endpoints; None = not given."""
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False


@dataclass
class ChatRequest:
    model: str
    messages: list[Message]
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]    # auto | none | required | {"type": "function", "function": {"name"}}
    sampling: Sampled
    logprobs: bool = False


@dataclass
class CompletionRequest:
    model: str
    prompt: str | list[int]
    sampling: Sampled
    logprobs: int | None = None


def canonical_arguments(arguments: Any) -> str:
    """A tool call's arguments as canonical JSON (sorted keys, no spaces); text that is not JSON stays as is."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _type(value: Any, kind: type | tuple[type, ...], param: str, what: str) -> Any:
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind in (int, float, (int, float)))
    if not ok:
        raise APIError(400, f"Invalid type for '{param}': expected {what}, got {type(value).__name__}.", param)
    return value


def _number(body: dict[str, Any], key: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    value = float(_type(value, (int, float), key, "a number"))
    if value < low or value > high or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise APIError(400, f"Invalid '{key}': {value} is not in {bound}.", key)
    return value


def _int(body: dict[str, Any], key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    value = _type(value, int, key, "an integer")
    if value < low or (high is not None and value > high):
        raise APIError(400, f"Invalid '{key}': {value} must be {'in [%d, %d]' % (low, high) if high else f'>= {low}'}.",
                       key)
    return value


def _content(value: Any, param: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            where = f"{param}[{j}]"
            if not isinstance(part, dict):
                raise APIError(400, f"Invalid type for '{where}': expected an object.", where)
            if part.get("type") != "text":
                raise APIError(400, f"'{where}.type' {part.get('type')!r} is not supported: this model reads text "
                                    "parts only.", f"{where}.type")
            parts.append(_type(part.get("text"), str, f"{where}.text", "a string"))
        return "".join(parts)
    raise APIError(400, f"Invalid type for '{param}': expected a string or a list of text parts.", param)


def _tool_calls(value: Any, param: str) -> tuple[tuple[str, str, str], ...]:
    if value is None:
        return ()
    calls = []
    for j, call in enumerate(_type(value, list, param, "an array")):
        where = f"{param}[{j}]"
        _type(call, dict, where, "an object")
        fn = _type(call.get("function"), dict, f"{where}.function", "an object")
        name = _type(fn.get("name"), str, f"{where}.function.name", "a string")
        args = fn.get("arguments", "{}")
        calls.append((str(call.get("id") or ""), name, canonical_arguments(args)))
    return tuple(calls)


def parse_messages(value: Any) -> list[Message]:
    """The agent sends the whole conversation on every call: the checks build their field names only for an
    error (formatting them for every message cost more than the checks)."""
    if not isinstance(value, list) or not value:
        raise APIError(400, "'messages' must be a non-empty array of chat messages.", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            _type(m, dict, f"messages[{i}]", "an object")
        role = m.get("role")
        if role not in ROLES:
            raise APIError(400, f"Invalid value for 'messages[{i}].role': {role!r}; expected one of "
                                f"{', '.join(ROLES)}.", f"messages[{i}].role")
        raw_calls = m.get("tool_calls") if role == "assistant" else None
        calls = _tool_calls(raw_calls, f"messages[{i}].tool_calls") if raw_calls is not None else ()
        if "content" not in m and not calls:
            raise APIError(400, f"Missing required parameter: 'messages[{i}].content'.", f"messages[{i}].content")
        tool_call_id = m.get("tool_call_id") or ""
        if role == "tool" and not isinstance(tool_call_id, str):
            raise APIError(400, f"Invalid type for 'messages[{i}].tool_call_id': expected a string.",
                           f"messages[{i}].tool_call_id")
        name = m.get("name") or ""
        if not isinstance(name, str):
            _type(name, str, f"messages[{i}].name", "a string")
        content = m.get("content")
        if not isinstance(content, str):
            content = _content(content, f"messages[{i}].content")
        out.append(Message("system" if role == "developer" else role, content, name, tool_call_id, calls))
    return out


def parse_tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    tools = []
    for i, tool in enumerate(_type(value, list, "tools", "an array")):
        where = f"tools[{i}]"
        _type(tool, dict, where, "an object")
        if tool.get("type", "function") != "function":
            raise APIError(400, f"Invalid value for '{where}.type': only 'function' tools are supported.", f"{where}.type")
        fn = _type(tool.get("function"), dict, f"{where}.function", "an object")
        _type(fn.get("name"), str, f"{where}.function.name", "a string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        _type(params, dict, f"{where}.function.parameters", "a JSON schema object")
        clean = {"name": fn["name"], "description": fn.get("description") or "", "parameters": params}
        tools.append({"type": "function", "function": clean})
    return tools


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    if value is None:
        return "auto"
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise APIError(400, f"Invalid 'tool_choice.function.name': {name!r} is not in 'tools'.",
                           "tool_choice.function.name")
        return value
    raise APIError(400, "Invalid 'tool_choice': expected 'auto', 'none', 'required' or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice")


def _sampled(body: dict[str, Any], max_key: str) -> Sampled:
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "Invalid 'stop': expected a non-empty string or an array of them.", "stop")
    if len(stop) > MAX_STOP:
        raise APIError(400, f"Invalid 'stop': at most {MAX_STOP} sequences, got {len(stop)}.", "stop")
    options = body.get("stream_options") or {}
    _type(options, dict, "stream_options", "an object")
    stream = bool(_type(body.get("stream", False), bool, "stream", "a boolean")) if body.get("stream") is not None else False
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise APIError(400, f"'{key}' is not supported (only 0): a penalty would sample from a distribution "
                                "other than the policy's, which the trainer cannot reproduce.", key)
    return Sampled(temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 0.0, 1.0, True),
                   max_tokens=_int(body, max_key, 1), n=_int(body, "n", 1, MAX_N) or 1, stop=stop,
                   seed=_int(body, "seed", -(2 ** 63)), stream=stream,
                   include_usage=bool(options.get("include_usage", False)))


def _check_keys(body: Any, known: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    unknown = sorted(set(body) - known - set(IGNORED))
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "Missing required parameter: 'model'.", "model")
    return body


CHAT_KEYS = {"model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
             "max_completion_tokens", "n", "stop", "seed", "logprobs", "top_logprobs", "stream",
             "presence_penalty", "frequency_penalty"}
COMPLETION_KEYS = {"model", "prompt", "temperature", "top_p", "max_tokens", "n", "stop", "seed", "logprobs", "stream",
                   "echo", "presence_penalty", "frequency_penalty"}


def parse_chat(body: Any) -> ChatRequest:
    body = _check_keys(body, CHAT_KEYS)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise APIError(400, "Give 'max_completion_tokens' or 'max_tokens', not both.", "max_tokens")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get("top_logprobs"):
        raise APIError(400, "'top_logprobs' > 0 is not supported: the engines return the sampled token's logprob "
                            "only (set logprobs=true without top_logprobs).", "top_logprobs")
    logprobs = body.get("logprobs")
    tools = parse_tools(body.get("tools"))
    return ChatRequest(body["model"], parse_messages(body.get("messages")), tools,
                       _tool_choice(body.get("tool_choice"), tools), _sampled(body, key),
                       bool(_type(logprobs, bool, "logprobs", "a boolean")) if logprobs is not None else False)


def parse_completion(body: Any) -> CompletionRequest:
    body = _check_keys(body, COMPLETION_KEYS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]    # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise APIError(400, "Invalid 'prompt': expected a string, or one array of token ids (batches of several "
                                "prompts are not supported; send one request each).", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise APIError(400, "Invalid 'prompt': expected a non-empty string or an array of token ids.", "prompt")
    if body.get("echo"):
        raise APIError(400, "'echo' is not supported.", "echo")
    logprobs = _int(body, "logprobs", 0, 1)
    sampling = _sampled(body, "max_tokens")
    if sampling.max_tokens is None:
        sampling.max_tokens = 16   # the Completions API's default
    return CompletionRequest(body["model"], prompt, sampling, logprobs)
