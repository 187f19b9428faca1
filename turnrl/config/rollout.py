"""Sampling, the agent loop and the data: `rollout.*` (with its sampling, tools and interaction) and `data.*`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from turnrl.config.checks import positive
from turnrl.config.loader import ConfigError


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 = off
    max_tokens_per_turn: int = 256

    def validate(self) -> None:
        positive("temperature", self.temperature, allow_zero=True)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"'top_p' must be in (0, 1], got {self.top_p}.")
        positive("top_k", self.top_k, allow_zero=True)
        positive("max_tokens_per_turn", self.max_tokens_per_turn)


@dataclass
class ToolSpec:
    """verl's tool config shape: `class_name` (module:Class, module.Class or a built-in name)."""
    class_name: str
    config: dict[str, Any] = field(default_factory=dict)
    tool_schema: dict[str, Any] | None = None


@dataclass
class InteractionSpec:
    name: str
    class_name: str
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutConfig:
    n: int = 4                           # samples per prompt (the GRPO group)
    max_assistant_turns: int = 4
    max_user_turns: int = 4              # tool + user turns together, as in verl
    max_response_tokens: int = 1024      # all policy + environment tokens after the prompt
    max_context_tokens: int = 4096
    concurrency: int = 256               # trajectories in flight
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    tool_parser: Literal["hermes", "llama3_json", "qwen3_coder", "pythonic", "mistral", "deepseek_v3", "auto"] = "hermes"
    #                                      chat/parsers PARSERS, or auto: detected from the template (chat/detect.py)
    max_parallel_calls: int = 4
    tool_timeout_s: float = 10.0
    max_tool_response_tokens: int = 256
    truncate_side: Literal["head", "tail", "middle"] = "middle"
    tool_errors_to_model: bool = True    # parse/tool errors become the tool response text
    on_mismatch: Literal["error", "warn", "split"] = "error"
    tools: list[ToolSpec] = field(default_factory=list)
    tool_config_path: str | None = None  # a verl-style tools YAML
    interactions: list[InteractionSpec] = field(default_factory=list)
    interaction_config_path: str | None = None
    interaction_timeout_s: float = 60.0

    def validate(self) -> None:
        for name in ("n", "max_assistant_turns", "max_response_tokens", "max_context_tokens", "concurrency",
                     "max_parallel_calls", "tool_timeout_s", "max_tool_response_tokens", "interaction_timeout_s"):
            positive(name, getattr(self, name))
        positive("max_user_turns", self.max_user_turns, allow_zero=True)


@dataclass
class DatasetConfig:
    path: str | None = None              # JSONL or Parquet
    task: str | None = None              # a built-in generated task
    size: int = 64                       # rows generated for a built-in task
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # task options, checked by the task
    max_rows: int | None = None

    def validate(self) -> None:
        if self.path is not None and self.task is not None:
            raise ConfigError("set only one of 'path' (a JSONL/Parquet file) or 'task' (a built-in task).")
        positive("size", self.size)


DEFAULT_TRAIN_TASK = "calculator"


@dataclass
class DataConfig:
    # A train set with neither path nor task is the built-in task: `data.train.size=32` alone keeps it, and
    # `data.train.path=x.jsonl` alone replaces it.
    train: DatasetConfig = field(default_factory=DatasetConfig)
    eval: DatasetConfig | None = None
    prompts_per_step: int = 8
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.train.path is None and self.train.task is None:
            self.train.task = DEFAULT_TRAIN_TASK

    def validate(self) -> None:
        positive("prompts_per_step", self.prompts_per_step)
        if self.eval is not None and self.eval.path is None and self.eval.task is None:
            raise ConfigError("'eval' needs 'path' (a JSONL/Parquet file) or 'task' (a built-in task).")
