"""Build the rollout parts (engine, chat template, parser, environment, loop) from config sections.

Components take plain arguments; this is the one place that reads config dataclasses for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from turnrl.chat.parsers import get_parser
from turnrl.chat.templates import ChatTemplate
from turnrl.config.schema import EngineConfig, InteractionSpec, RolloutConfig, ToolSpec
from turnrl.engines.base import Engine, Sampling
from turnrl.env.loading import (BUILTIN_INTERACTIONS, BUILTIN_TOOLS, interaction_factory, read_interaction_config,
                                read_tool_config, tool_factory)
from turnrl.rollout.loop import AgentLoop, Environment, Limits


def build_environment(cfg: RolloutConfig) -> Environment:
    """Configured tools and interactions by name; built-ins are available under their own names.

    A row that names no tools gets the configured ones, not the built-ins: those are only there for rows
    (and built-in tasks) that ask for them by name.
    """
    specs = list(cfg.tools) + (read_tool_config(cfg.tool_config_path) if cfg.tool_config_path else [])
    tools: dict[str, Any] = {}
    for spec in specs:
        name, make = tool_factory(spec)
        if name in tools:
            raise ValueError(f"two tools are named '{name}'; tool names must be unique")
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
    return Environment(tools, interactions, cfg.tool_timeout_s, cfg.max_parallel_calls, cfg.max_tool_response_tokens,
                       cfg.truncate_side, cfg.tool_errors_to_model, cfg.interaction_timeout_s, configured)


def _lazy(make_factory: Any) -> Any:
    """A factory that imports its target only when a trajectory first needs it."""
    cache: list[Any] = []

    def make() -> Any:
        if not cache:
            cache.append(make_factory())
        return cache[0]()
    return make


def load_template(model_dir: str | Path) -> ChatTemplate:
    from transformers import AutoTokenizer
    return ChatTemplate(AutoTokenizer.from_pretrained(str(model_dir)))


def build_engine(cfg: EngineConfig, model_dir: str | Path) -> Engine:
    if cfg.kind == "hf":
        from turnrl.engines.fast import build_hf_engine
        return build_hf_engine(str(model_dir), cfg.fast, device=cfg.device, dtype=cfg.dtype,
                               max_batch_size=cfg.max_batch_size, max_len=cfg.max_model_len, gather_ms=cfg.gather_ms,
                               seed=cfg.seed,
                               prefix_cache_tokens=cfg.prefix_cache_tokens if cfg.enable_prefix_caching else 0)
    if cfg.kind == "vllm":
        from turnrl.engines.vllm import VLLMEngine
        return VLLMEngine.from_config(str(model_dir), cfg)
    raise ValueError(f"unknown engine kind {cfg.kind!r}")


def sampling_from(cfg: RolloutConfig) -> Sampling:
    s = cfg.sampling
    return Sampling(max_tokens=s.max_tokens_per_turn, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)


def build_loop(cfg: RolloutConfig, engine: Engine, template: ChatTemplate, env: Environment, seed: int,
               sampling: Sampling | None = None, policy_version: int = 0) -> AgentLoop:
    s = sampling or sampling_from(cfg)
    if getattr(engine, "truncated_sampling", True) is False and (s.top_p < 1.0 or s.top_k > 0):
        raise ValueError("this engine cannot report full-distribution logprobs under top-p/top-k: set "
                         "rollout.sampling.top_p=1 and rollout.sampling.top_k=0, or use engine.kind=hf")
    limits = Limits(cfg.max_assistant_turns, cfg.max_user_turns, cfg.max_response_tokens, cfg.max_context_tokens)
    return AgentLoop(engine, template, get_parser(cfg.tool_parser), env, limits, s,
                     cfg.on_mismatch, seed, policy_version)
