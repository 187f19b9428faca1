"""Adapters that run classes written against verl's tool and interaction interfaces, without verl.

verl tool: `__init__(config, tool_schema)`, async `create(instance_id, **kwargs)`, async
`execute(instance_id, parameters, **kwargs) -> (response, step_reward, metrics)`, async
`calc_reward(instance_id)`, async `release(instance_id)`. verl's own agent loop calls create -> execute ->
release around every single call (state is lost) and never calls calc_reward; here one adapter instance
lives for the whole trajectory, so state persists and calc_reward is called at the end.

verl interaction: `__init__(config)`, async `start_interaction(instance_id, **kwargs)`,
`generate_response(instance_id, messages, **kwargs) -> (terminate, text, score, extra)`,
`calculate_score(instance_id)`, `finalize_interaction(instance_id)`; all are called here.
"""

from __future__ import annotations

import inspect
import itertools
from types import SimpleNamespace
from typing import Any, Callable

from turnrl.config.schema import InteractionSpec, ToolSpec
from turnrl.env.interactions import Reply
from turnrl.env.loading import INTERACTION_ADAPTERS, TOOL_ADAPTERS
from turnrl.env.tools import maybe_await

_ids = itertools.count()


def _takes(cls: type, method: str, param: str) -> bool:
    fn = getattr(cls, method, None)
    return fn is not None and param in inspect.signature(fn).parameters


def is_verl_tool(cls: type) -> bool:
    return hasattr(cls, "calc_reward") and _takes(cls, "execute", "instance_id")


def is_verl_interaction(cls: type) -> bool:
    return hasattr(cls, "generate_response") and hasattr(cls, "start_interaction")


def _namespace(value: Any) -> Any:
    """Nested dicts as attribute namespaces with `model_dump()`, standing in for verl's pydantic schema."""
    if isinstance(value, dict):
        ns = SimpleNamespace(**{k: _namespace(v) for k, v in value.items()})
        ns.model_dump = lambda *a, **k: value
        return ns
    if isinstance(value, list):
        return [_namespace(v) for v in value]
    return value


class VerlToolAdapter:
    def __init__(self, cls: type, spec: ToolSpec):
        if spec.tool_schema is None:
            raise ValueError(f"verl tool '{spec.class_name}' needs a 'tool_schema' in its config.")
        self.schema = spec.tool_schema
        self.name = spec.tool_schema.get("function", {}).get("name", cls.__name__)
        self.inner = cls(config=dict(spec.config), tool_schema=_namespace(spec.tool_schema))
        self.instance_id = f"turnrl-{next(_ids)}"

    async def create(self, **kwargs: Any) -> None:
        kwargs = dict(kwargs.get("create_kwargs", kwargs))
        result = await maybe_await(self.inner.create(self.instance_id, **kwargs))
        if isinstance(result, tuple):
            result = result[0]
        if isinstance(result, str) and result:
            self.instance_id = result

    async def execute(self, args: dict[str, Any]) -> Any:
        return await maybe_await(self.inner.execute(self.instance_id, args))

    async def reward(self) -> Any:
        return await maybe_await(self.inner.calc_reward(self.instance_id))

    async def release(self) -> None:
        await maybe_await(self.inner.release(self.instance_id))


def verl_tool_factory(cls: type, spec: ToolSpec) -> tuple[str, Callable[[], VerlToolAdapter]]:
    probe = VerlToolAdapter(cls, spec)
    return probe.name, lambda: VerlToolAdapter(cls, spec)


class VerlInteractionAdapter:
    def __init__(self, cls: type, spec: InteractionSpec):
        self.inner = cls(dict(spec.config))
        self.instance_id = f"turnrl-{next(_ids)}"

    async def start(self, **kwargs: Any) -> None:
        result = await maybe_await(self.inner.start_interaction(self.instance_id, **kwargs))
        if isinstance(result, str) and result:
            self.instance_id = result

    async def respond(self, messages: list[dict[str, Any]]) -> Reply:
        done, text, score, extra = await maybe_await(self.inner.generate_response(self.instance_id, messages))
        return Reply(str(text), bool(done), float(score or 0.0), dict(extra or {}))

    async def finish(self) -> float | None:
        score = None
        try:
            if hasattr(self.inner, "calculate_score"):
                score = await maybe_await(self.inner.calculate_score(self.instance_id))
        finally:  # finalize releases the instance's resources, even when scoring failed
            if hasattr(self.inner, "finalize_interaction"):
                await maybe_await(self.inner.finalize_interaction(self.instance_id))
        return None if score is None else float(score)


def verl_interaction_factory(cls: type, spec: InteractionSpec) -> Callable[[], VerlInteractionAdapter]:
    return lambda: VerlInteractionAdapter(cls, spec)


TOOL_ADAPTERS.append(lambda cls, spec: verl_tool_factory(cls, spec) if is_verl_tool(cls) else None)
INTERACTION_ADAPTERS.append(lambda cls, spec: verl_interaction_factory(cls, spec) if is_verl_interaction(cls) else None)
