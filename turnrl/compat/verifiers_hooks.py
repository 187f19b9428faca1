"""Registers the verifiers integration (`verifiers_env.py`) with the layers below: its rows as a task source
(turnrl.data), its tools as a tool source and its environment as an interaction (turnrl.env). verifiers itself
is imported only when a config names it: it is a large, optional dependency."""

from __future__ import annotations

from typing import Any

from turnrl.data.tasks import TASK_SOURCES
from turnrl.env.loading import BUILTIN_INTERACTIONS, TOOL_SOURCES


def _tasks(**options: Any) -> Any:
    from turnrl.compat.verifiers_env import verifiers_tasks
    return verifiers_tasks(**options)


def _tools(config: dict[str, Any], where: str) -> Any:
    from turnrl.compat.verifiers_env import verifiers_tool_factories
    return verifiers_tool_factories(config, where)


TASK_SOURCES["verifiers"] = _tasks
TOOL_SOURCES["verifiers"] = _tools
BUILTIN_INTERACTIONS["verifiers"] = "turnrl.compat.verifiers_env:VerifiersInteraction"
