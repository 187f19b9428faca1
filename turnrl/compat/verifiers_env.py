"""verifiers environments (the classic API: SingleTurnEnv, MultiTurnEnv, ToolEnv, StatefulToolEnv) in
turnrl's one agent loop. Config: `env: {verifiers: "module:load_environment" | a name, args: {...}}`.

verifiers' own `MultiTurnEnv.rollout` asks a chat client for each turn and re-renders messages; here turnrl's
loop samples the tokens and the environment is driven turn by turn through its public hooks, in the order its
rollout calls them (verifiers/envs/multiturn_env.py):

    start:  init_state(row) -> setup_state(state)
    after every assistant turn (tool calls or not): append the trajectory step -> is_completed(state) (the
            @vf.stop conditions: max_turns, no_tools_called, final_env_response, yours) -> env_response(),
            whose messages (tool results, user turns) go back to the policy
    finish: cleanup(state) (renders the completion) -> rubric.score_rollout(state): the weighted reward is the
            trajectory's `interaction` reward part, each reward function's value the metric interaction/<name>

The dataset (`get_dataset()` / `get_eval_dataset()`, system prompt and few-shot already in each prompt) becomes
the rows; the tool_defs become the prompt's tool schemas. ToolEnv/StatefulToolEnv run their tools inside
env_response as in verifiers (update_tool_args, error_formatter, stop_errors); a tool that raises is also
recorded on the trajectory and masks it (turnrl's rule), while an unknown tool or arguments that do not fit
the schema stay the policy's error. Refused with a ConfigError: EnvGroup, environments that are not
MultiTurnEnv or override get_prompt_messages (non-linear conversations), group reward functions and
environment advantages (turnrl computes advantages), `message_type: completion`, per-row `info.tool_defs`.
"""

from __future__ import annotations

import contextvars
import json
from typing import Any

import verifiers as vf
from verifiers.legacy.clients.client import Client
from verifiers.legacy.envs.multiturn_env import MultiTurnEnv
from verifiers.legacy.utils.message_utils import maybe_normalize_messages

from turnrl.config.loader import ConfigError
from turnrl.data.rows import Task
from turnrl.env.interactions import Reply
from turnrl.env.loading import import_object
from turnrl.env.tools import check_arguments

_ENVS: dict[str, Any] = {}
_ROWS: dict[tuple[str, str], list[dict[str, Any]]] = {}
_TOOL_ERRORS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("vf_tool_errors", default=None)


def _key(env: str, args: dict[str, Any]) -> str:
    return json.dumps([env, args], sort_keys=True, default=str)


def load_env(env: str, args: dict[str, Any] | None = None) -> Any:
    """The environment (loaded once per process and config), checked for what turnrl can run."""
    args = dict(args or {})
    key = _key(env, args)
    if key in _ENVS:
        return _ENVS[key]
    if ":" in env:
        target = import_object(env)
        try:
            obj = target(**args) if callable(target) and not isinstance(target, vf.Environment) else target
        except TypeError as exc:
            raise ConfigError(f"env.verifiers '{env}' cannot be called with env.args {args}: {exc}") from None
    else:
        try:
            obj = vf.load_environment(env, **args)
        except Exception as exc:  # noqa: BLE001 - verifiers says what is missing
            raise ConfigError(f"verifiers cannot load environment '{env}': {type(exc).__name__}: {exc}. Install "
                              "it (pip install <its package>) or write module:load_environment.") from None
    _check(obj, env)
    _watch_tools(obj)
    _ENVS[key] = obj
    return obj


def _check(obj: Any, name: str) -> None:
    def refuse(why: str) -> None:
        raise ConfigError(f"verifiers environment '{name}' ({type(obj).__name__}): {why}")
    if not isinstance(obj, vf.Environment):
        refuse(f"load_environment returned a {type(obj).__name__}, not a vf.Environment.")
    if isinstance(obj, vf.EnvGroup):
        refuse("EnvGroup is not supported: configure one environment per run.")
    if not isinstance(obj, MultiTurnEnv):
        refuse("only MultiTurnEnv subclasses (SingleTurnEnv, MultiTurnEnv, ToolEnv, StatefulToolEnv) run in "
               "turnrl's loop; an Environment with its own rollout() does not.")
    if type(obj).get_prompt_messages is not MultiTurnEnv.get_prompt_messages:
        refuse("it overrides get_prompt_messages (a non-linear conversation); turnrl's ledger appends turns, so "
               "this is not supported.")
    if getattr(obj, "message_type", "chat") != "chat":
        refuse("message_type 'completion' is not supported; turnrl renders chat messages with the model's template.")
    if obj.rubric.has_group_rewards or obj.provides_advantages:
        refuse("group reward functions and environment advantages are not supported: turnrl scores each "
               "trajectory and computes advantages itself (rollout.n, algo.advantage).")


def tool_schemas(env: Any) -> list[dict[str, Any]]:
    """The environment's tool_defs as OpenAI function schemas (what the chat template renders)."""
    return [{"type": "function", "function": {
        "name": t.name, "description": t.description or t.name,
        "parameters": dict(t.parameters or {"type": "object", "properties": {}})}} for t in (env.tool_defs or [])]


def _watch_tools(env: Any) -> None:
    """Record a ToolEnv tool that raises (verifiers formats the error for the model; turnrl also masks)."""
    if not isinstance(env, vf.ToolEnv):
        return
    original = env.call_tool
    schemas = {t["function"]["name"]: t for t in tool_schemas(env)}

    async def call_tool(tool_name: str, tool_args: dict, tool_call_id: str, **kwargs: Any) -> Any:
        try:
            return await original(tool_name, tool_args, tool_call_id, **kwargs)
        except Exception as exc:
            errors = _TOOL_ERRORS.get()
            # An unknown tool or arguments that do not fit are the policy's errors, not the environment's.
            if errors is not None and tool_name in schemas and not check_arguments(schemas[tool_name], tool_args):
                errors.append(f"tool '{tool_name}' raised {type(exc).__name__}: {exc}")
            raise
    env.call_tool = call_tool


def _rows(env_name: str, args: dict[str, Any], split: str) -> list[dict[str, Any]]:
    key = (_key(env_name, args), split)
    if key not in _ROWS:
        env = load_env(env_name, args)
        source = env.eval_dataset_source if split == "eval" else env.dataset_source
        if source is None:
            raise ConfigError(f"verifiers environment '{env_name}' has no {split} dataset.")
        dataset = env.get_eval_dataset() if split == "eval" else env.get_dataset()
        _ROWS[key] = [dict(r) for r in dataset]
    return _ROWS[key]


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else getattr(p, "text", "") or "" for p in content)
    return "" if content is None else str(content)


def _plain(message: Any) -> dict[str, Any]:
    m = message if isinstance(message, dict) else message.model_dump()
    return {"role": m["role"], "content": _text(m.get("content"))}


def verifiers_tasks(env: str, args: dict[str, Any] | None = None, split: str = "train") -> list[Task]:
    """The environment's dataset as turnrl rows, each played by the `verifiers` interaction."""
    args = dict(args or {})
    if split not in ("train", "eval"):
        raise ConfigError(f"verifiers split must be train or eval, got {split!r}")
    tasks = []
    for i, row in enumerate(_rows(env, args, split)):
        info = row.get("info")
        info = json.loads(info) if isinstance(info, str) and info else (info or {})
        if isinstance(info, dict) and "tool_defs" in info:
            raise ConfigError(f"verifiers environment '{env}': per-row info.tool_defs are not supported.")
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [_plain(m) for m in prompt]
        tasks.append(Task(uid=f"{split}-{row.get('example_id', i)}", messages=messages, index=i,
                          interaction={"name": "verifiers", "split": split, "row": i},
                          ground_truth=row.get("answer"), data_source=f"verifiers:{env}",
                          extra={"task": row.get("task", ""), "info": info}))
    return tasks


class _EnvTool:
    """A tool's schema for the prompt; its calls are run by the environment (the interaction takes them)."""

    def __init__(self, schema: dict[str, Any]):
        self.schema, self.name = schema, schema["function"]["name"]

    def execute(self, args: dict[str, Any]) -> str:
        raise RuntimeError("verifiers tools run inside the environment's env_response, not as turnrl tools")


def verifiers_tool_factories(config: dict[str, Any], where: str = "tools") -> list[tuple[str, Any]]:
    """(name, factory) of the environment's tools, for the prompt's schemas."""
    if set(config) - {"env", "args"} or "env" not in config:
        raise ConfigError(f"{where}: a verifiers tool entry takes config {{env, args}}, got {sorted(config)}.")
    env = load_env(config["env"], config.get("args"))
    return [(s["function"]["name"], (lambda s=s: _EnvTool(s))) for s in tool_schemas(env)]


class _PolicyIsTurnrl(Client):
    """verifiers' state wants a client; turnrl's loop samples the policy, so this one is never called."""

    def __init__(self) -> None:  # no API client is set up
        self.logger = None

    def _never(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("turnrl samples the policy itself; the verifiers client is not used")

    setup_client = to_native_tool = to_native_prompt = get_native_response = _never
    raise_from_native_response = from_native_response = close = _never


class VerifiersInteraction:
    """One trajectory of a verifiers environment (see the module doc)."""
    takes_tool_calls = True

    def __init__(self, env: str, args: dict[str, Any] | None = None):
        self.env_name, self.args = env, dict(args or {})
        self.env = load_env(env, self.args)
        self.state: Any = None
        self.messages: list[Any] = []

    async def start(self, split: str = "train", row: int = 0) -> None:
        rows = _rows(self.env_name, self.args, split)
        self.state = await self.env.init_state(rows[row], _PolicyIsTurnrl(), "turnrl")
        state = await self.env.setup_state(self.state)
        if state is not None:
            self.state = state
        self.messages = list(self.state["prompt"])

    async def respond(self, messages: list[dict[str, Any]]) -> Reply:
        last, state = messages[-1], self.state
        calls = [vf.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                 for c in last.get("tool_calls") or []]
        said = vf.AssistantMessage(content=last.get("content") or "", tool_calls=calls or None)
        state["trajectory"].append({"prompt": list(self.messages), "completion": [said], "response": None,
                                    "tokens": None, "reward": None, "advantage": None, "is_truncated": False,
                                    "trajectory_id": state["trajectory_id"], "extras": {}})
        self.messages.append(said)
        if await self.env.is_completed(state):
            return Reply("", done=True)
        errors: list[str] = []
        token = _TOOL_ERRORS.set(errors)
        try:
            answer = await self.env.env_response(list(self.messages), state)
        except vf.Error as exc:  # verifiers' own rule: the rollout stops with the error in its state
            state["error"] = exc
            return Reply("", done=True, errors=[f"env_response: {type(exc).__name__}: {exc}"])
        finally:
            _TOOL_ERRORS.reset(token)
        answer = maybe_normalize_messages(answer, field_name="env_response")
        if state.get("final_env_response") is not None:  # the environment ended it (the rubric sees it)
            return Reply("", done=True, errors=errors)
        self.messages.extend(answer)
        names = {c.id: c.name for c in calls}
        out = []
        for m in answer:
            d = _plain(m)
            if d["role"] == "tool":
                d.update(tool_call_id=m.tool_call_id, name=names.get(m.tool_call_id, ""))
            out.append(d)
        return Reply("", messages=out, errors=errors)

    async def finish(self) -> dict[str, float] | None:
        state = self.state
        if state is None:
            return None
        state["is_completed"] = True
        await self.env.cleanup(state)      # renders state["completion"], runs the environment's cleanup handlers
        if state.get("error") is not None:
            return None
        await self.env.rubric.score_rollout(state)
        return {"score": float(state["reward"]), **{k: float(v) for k, v in (state["metrics"] or {}).items()}}
