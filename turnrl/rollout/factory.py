"""Build the rollout parts (engine, chat template, parser, environment, loop) from config sections.

Components take plain arguments; this is the one place that reads config dataclasses for them.
"""

from __future__ import annotations

from typing import Any

from turnrl.chat.detect import parser_for
from turnrl.chat.templates import ChatTemplate, load_template  # noqa: F401 (re-exported)
from turnrl.config.schema import InteractionSpec, RolloutConfig, ToolSpec
from turnrl.engines.base import Engine, Sampling
from turnrl.engines.factory import build_engine  # noqa: F401 (re-exported)
from turnrl.env.loading import (BUILTIN_INTERACTIONS, BUILTIN_TOOLS, interaction_factory, read_interaction_config,
                                read_tool_config, tool_factories, tool_factory)
from turnrl.rollout.loop import AgentLoop, Environment, Limits


def build_environment(cfg: RolloutConfig) -> Environment:
    """Configured tools and interactions by name; built-ins are available under their own names.

    A row that names no tools gets the configured ones, not the built-ins: those are only there for rows
    (and built-in tasks) that ask for them by name.
    """
    specs = list(cfg.tools) + (read_tool_config(cfg.tool_config_path) if cfg.tool_config_path else [])
    tools: dict[str, Any] = {}
    for i, spec in enumerate(specs):
        for name, make in tool_factories(spec, f"rollout.tools[{i}]"):
            if name in tools:
                raise ValueError(f"two tools are named '{name}'; tool names must be unique (an mcp server's "
                                 "tools take a 'prefix')")
            tools[name] = make
    configured = list(tools)
    for name in BUILTIN_TOOLS:
        if name not in tools:
            tools[name] = _lazy(lambda n=name: tool_factory(ToolSpec(class_name=n))[1])
    ispecs = list(cfg.interactions) + (read_interaction_config(cfg.interaction_config_path)
                                       if cfg.interaction_config_path else [])
    interactions: dict[str, Any] = {}
    for spec in ispecs:
        if spec.name in interactions:
            raise ValueError(f"two interactions are named '{spec.name}'")
        interactions[spec.name] = interaction_factory(spec)
    for name in BUILTIN_INTERACTIONS:
        interactions.setdefault(name, _lazy(lambda n=name: interaction_factory(InteractionSpec(n, n))))
    return Environment(tool_factories=tools, interaction_factories=interactions, tool_timeout_s=cfg.tool_timeout_s,
                       max_parallel_calls=cfg.max_parallel_calls, max_tool_response_tokens=cfg.max_tool_response_tokens,
                       truncate_side=cfg.truncate_side, tool_errors_to_model=cfg.tool_errors_to_model,
                       interaction_timeout_s=cfg.interaction_timeout_s, default_tools=configured)


def _lazy(make_factory: Any) -> Any:
    """A factory that imports its target only when a trajectory first needs it."""
    cache: list[Any] = []

    def make() -> Any:
        if not cache:
            cache.append(make_factory())
        return cache[0]()
    return make


def sampling_from(cfg: RolloutConfig) -> Sampling:
    s = cfg.sampling
    return Sampling(max_tokens=s.max_tokens_per_turn, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)


def build_loop(cfg: RolloutConfig, engine: Engine, template: ChatTemplate, env: Environment, seed: int,
               sampling: Sampling | None = None, policy_version: int = 0) -> AgentLoop:
    s = sampling or sampling_from(cfg)
    if not engine.capabilities.truncated_sampling and (s.top_p < 1.0 or s.top_k > 0):
        raise ValueError("this engine cannot report full-distribution logprobs under top-p/top-k: set "
                         "rollout.sampling.top_p=1 and rollout.sampling.top_k=0, or use engine.kind=hf")
    # The engine's own limit (engine.max_model_len) bounds the context too: past it every request would fail.
    context = min(cfg.max_context_tokens, engine.max_model_len or cfg.max_context_tokens)
    limits = Limits(max_assistant_turns=cfg.max_assistant_turns, max_user_turns=cfg.max_user_turns,
                    max_response_tokens=cfg.max_response_tokens, max_context_tokens=context)
    return AgentLoop(engine, template, parser_for(cfg.tool_parser, template), env, limits, s, on_mismatch=cfg.on_mismatch,
                     seed=seed, policy_version=policy_version)
