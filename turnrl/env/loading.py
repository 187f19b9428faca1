"""Turn config names into tool and interaction factories.

A name is a built-in (`calculator`), `package.module:Name`, `package.module.Name`, or `path/to/file.py:Name`;
`mcp` brings every tool of an MCP server (turnrl/env/mcp_tools.py). Only what a config names is imported.
A factory builds a fresh instance per trajectory.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

import yaml

from turnrl.config.loader import ConfigError, build
from turnrl.config.schema import InteractionSpec, ToolSpec
from turnrl.env.tools import FunctionTool, Tool

BUILTIN_TOOLS = {
    "calculator": "turnrl.env.builtin.calculator:Calculator",
    "check_answer": "turnrl.env.builtin.checker:AnswerChecker",
    "python": "turnrl.env.builtin.python_sandbox:PythonSandbox",
}
BUILTIN_INTERACTIONS = {
    "math_feedback": "turnrl.env.builtin.feedback:MathFeedback",
    "guess_number": "turnrl.env.builtin.guess:GuessNumberUser",
    "llm_user": "turnrl.env.builtin.llm_user:LLMUser",
}   # integrations above this layer add theirs (turnrl.compat adds "verifiers")


def import_object(name: str) -> Any:
    if ":" in name:
        module_name, _, attr = name.rpartition(":")
    elif "." in name:
        module_name, _, attr = name.rpartition(".")
    else:
        raise ConfigError(f"'{name}' is not importable: write module:Name, module.Name or file.py:Name.")
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"'{name}': file {path} does not exist.")
        mod_key = f"turnrl_user_{abs(hash(str(path)))}"
        module = sys.modules.get(mod_key)
        if module is None:
            spec = importlib.util.spec_from_file_location(mod_key, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_key] = module
            try:
                spec.loader.exec_module(module)
            except Exception as exc:  # a half-run module must not be cached and found by the next lookup
                del sys.modules[mod_key]
                raise ConfigError(f"'{name}': running {path} failed: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"'{name}': cannot import module '{module_name}' ({exc}).") from None
    if not hasattr(module, attr):
        raise ConfigError(f"'{name}': module '{module_name}' has no attribute '{attr}'.")
    return getattr(module, attr)


def _resolve(name: str, builtins: dict[str, str], what: str) -> Any:
    if name not in builtins and ":" not in name and "." not in name:
        close = difflib.get_close_matches(name, list(builtins), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown {what} '{name}'.{hint} Built-ins: {', '.join(builtins)}; "
                          "or write module:Name or path/to/file.py:Name.")
    return import_object(builtins.get(name, name))


# Adapters for classes written against another framework's interfaces, registered from outside env by
# `turnrl.compat` (verl's BaseTool / BaseInteraction): each takes (class, spec) and returns what `tool_factory`
# (`interaction_factory`) would, or None when the class is not of its kind.
ToolAdapter = Callable[[type, ToolSpec], "tuple[str, Callable[[], Tool]] | None"]
InteractionAdapter = Callable[[type, InteractionSpec], "Callable[[], Any] | None"]
TOOL_ADAPTERS: list[ToolAdapter] = []
INTERACTION_ADAPTERS: list[InteractionAdapter] = []
# `class_name`s that stand for a whole set of tools: (config, where) -> [(name, factory)]; integrations above
# this layer register theirs (turnrl.compat registers "verifiers").
TOOL_SOURCES: dict[str, Callable[[dict[str, Any], str], list[tuple[str, Callable[[], Tool]]]]] = {}


def tool_factories(spec: ToolSpec, where: str = "tools") -> list[tuple[str, Callable[[], Tool]]]:
    """(tool name, factory) for each tool a spec brings: one, or every tool an MCP server lists."""
    if spec.class_name == "mcp":
        if spec.tool_schema is not None:
            raise ConfigError(f"{where}: an mcp tool's schemas come from the server: drop 'tool_schema'.")
        from turnrl.env.mcp_tools import mcp_tool_factories  # the mcp SDK, only when a config names it
        return mcp_tool_factories(spec.config, where)
    if spec.class_name in TOOL_SOURCES:
        return TOOL_SOURCES[spec.class_name](spec.config, where)
    return [tool_factory(spec)]


def tool_factory(spec: ToolSpec) -> tuple[str, Callable[[], Tool]]:
    """(tool name, factory) for one tool spec."""
    target = _resolve(spec.class_name, BUILTIN_TOOLS, "tool")
    if inspect.isclass(target):
        for adapt in TOOL_ADAPTERS:
            adapted = adapt(target, spec)
            if adapted is not None:
                return adapted

        def make() -> Tool:
            tool = target(**spec.config)
            if spec.tool_schema is not None:  # the model calls the tool by the schema's name
                tool.schema = spec.tool_schema
                tool.name = _schema_name(spec)
            return tool
    elif callable(target):
        if spec.config:
            raise ConfigError(f"tool '{spec.class_name}' is a function: it takes no 'config'.")

        def make() -> Tool:
            tool = FunctionTool(target)
            if spec.tool_schema is not None:
                tool.schema = spec.tool_schema
                tool.name = _schema_name(spec)
            return tool
    else:
        raise ConfigError(f"tool '{spec.class_name}' is neither a class nor a function.")
    try:
        probe = make()
    except ConfigError:
        raise
    except Exception as exc:  # e.g. a constructor that does not take the configured keys
        raise ConfigError(f"tool '{spec.class_name}' cannot be built with config {spec.config}: "
                          f"{type(exc).__name__}: {exc}") from exc
    for attr in ("name", "schema", "execute"):
        if not hasattr(probe, attr):
            raise ConfigError(f"tool '{spec.class_name}' has no '{attr}': a tool needs name, schema and execute().")
    return probe.name, make


def _schema_name(spec: ToolSpec) -> str:
    schema = spec.tool_schema or {}
    name = (schema.get("function") or schema).get("name") if isinstance(schema, dict) else None
    if not isinstance(name, str) or not name:
        raise ConfigError(f"tool '{spec.class_name}': its tool_schema has no function name "
                          "(expected {type: function, function: {name: ..., parameters: ...}}).")
    return name


def interaction_factory(spec: InteractionSpec) -> Callable[[], Any]:
    target = _resolve(spec.class_name, BUILTIN_INTERACTIONS, "interaction")
    if not inspect.isclass(target):
        raise ConfigError(f"interaction '{spec.name}': '{spec.class_name}' is not a class.")
    for adapt in INTERACTION_ADAPTERS:
        adapted = adapt(target, spec)
        if adapted is not None:
            return adapted
    return lambda: target(**spec.config)


def read_tool_config(path: str) -> list[ToolSpec]:
    """A verl-style tools YAML: `tools: [{class_name, config, tool_schema}, ...]`."""
    data = _read_yaml_list(path, "tools")
    return [build(ToolSpec, item, prefix=f"{path}:tools[{i}]") for i, item in enumerate(data)]


def read_interaction_config(path: str) -> list[InteractionSpec]:
    """A verl-style interaction YAML: `interaction: [{name, class_name, config}, ...]`."""
    data = _read_yaml_list(path, "interaction")
    return [build(InteractionSpec, item, prefix=f"{path}:interaction[{i}]") for i, item in enumerate(data)]


def _read_yaml_list(path: str, key: str) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"'{path}' does not exist.")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict) or not isinstance(data.get(key), list):
        raise ConfigError(f"'{path}' must hold a top-level '{key}:' list.")
    return data[key]
