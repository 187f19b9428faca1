"""The config tree: one dataclass per component.

Components never receive this tree; `cli.py` and the trainer unpack the fields they need into plain
arguments. Each dataclass validates its own values in `validate()` (called by the loader) and raises
`ConfigError` with the key and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from turnrl.config.checks import positive
from turnrl.config.engine import VLLM_LORA_RANKS, EngineConfig, LoraConfig, ModelConfig
from turnrl.config.loader import ConfigError, secret
from turnrl.config.reward import (COMPUTED_METRICS, JUDGED_METRICS, JudgeConfig, LLMConfig, OverlongConfig,
                                  RewardConfig)
from turnrl.config.rollout import (DEFAULT_TRAIN_TASK, DataConfig, DatasetConfig, InteractionSpec, RolloutConfig,
                                   SamplingConfig, ToolSpec)
from turnrl.config.train import (LOSS_MODES, AlgoConfig, FilterGroupsConfig, OptimConfig, RolloutCorrectionConfig,
                                 SFTConfig, TrainerConfig)

__all__ = ["COMPUTED_METRICS", "DEFAULT_TRAIN_TASK", "JUDGED_METRICS", "LOSS_MODES", "VLLM_LORA_RANKS", "AgentConfig",
           "AlgoConfig", "Config", "DataConfig", "DatasetConfig", "EngineConfig", "EnvConfig", "FilterGroupsConfig",
           "InteractionSpec", "JudgeConfig", "LLMConfig", "LoggingConfig", "LoraConfig", "ModelConfig",
           "OptimConfig", "OverlongConfig", "RewardConfig", "RolloutConfig", "RolloutCorrectionConfig",
           "SFTConfig", "SamplingConfig", "ToolSpec", "TrainerConfig"]


@dataclass
class LoggingConfig:
    sinks: list[Literal["console", "tensorboard", "wandb", "mlflow"]] = field(default_factory=lambda: ["console"])
    project: str = "turnrl"
    run_name: str | None = None
    wandb_api_key: str | None = secret()   # env:NAME or file:PATH (see turnrl.config.secrets); unset: WANDB_API_KEY
    progress: Literal["auto", "on", "off"] = "auto"
    engine_logs: bool = False            # the engine's INFO log on the console too (default: warnings and errors;
    #                                      the full log goes to <output_dir>/engine.log)

    def validate(self) -> None:
        key = self.wandb_api_key or ""
        if key in ("env:", "file:"):
            raise ConfigError(f"'wandb_api_key' is '{key}' with nothing after it: write env:VARIABLE or file:/path.")


@dataclass
class EnvConfig:
    """An environment from another framework that brings its own rows, tools, env turns and reward."""
    verifiers: str | None = None         # module:load_environment, path.py:load_environment, or a name verifiers
    #                                      loads (an installed environment package)
    args: dict[str, Any] = field(default_factory=dict)     # keyword arguments of load_environment
    eval: bool = False                   # also evaluate on the environment's eval dataset (trainer.eval_every)

    def expand(self, cfg: Config) -> None:
        """Point the data, the tools and the interaction at the environment (turnrl/compat/verifiers_env.py);
        idempotent, so a saved config loads again."""
        if self.verifiers is None:
            return
        spec = {"env": self.verifiers, "args": self.args}
        train = cfg.data.train
        if train.path is not None or train.task not in (DEFAULT_TRAIN_TASK, "verifiers"):
            raise ConfigError("env.verifiers brings its own rows: remove data.train.path / data.train.task.")
        cfg.data.train = DatasetConfig(task="verifiers", options={**spec, "split": "train"}, max_rows=train.max_rows)
        if self.eval:
            cfg.data.eval = DatasetConfig(task="verifiers", options={**spec, "split": "eval"})
        if not any(t.class_name == "verifiers" for t in cfg.rollout.tools):
            cfg.rollout.tools.append(ToolSpec("verifiers", dict(spec)))
        if not any(i.name == "verifiers" for i in cfg.rollout.interactions):
            cfg.rollout.interactions.append(InteractionSpec("verifiers", "verifiers", dict(spec)))


@dataclass
class AgentConfig:
    """Your own agent, trained through the gateway (turnrl/gateway/agents.py): set `entrypoint` or `command`."""
    entrypoint: str | None = None        # "pkg.module:run" or "path/agent.py:run": run(row, client) -> reward or None
    command: list[str] | None = None     # a process per session, given OPENAI_BASE_URL, TURNRL_TASK (JSON), ...
    returns_reward: bool = True          # the agent returns the reward (part 'agent'); false: reward.functions only
    reward_weight: float = 1.0           # of the returned reward in the total
    timeout_s: float = 300.0             # per session; a session past it is an agent error (masked)
    env: dict[str, str] = field(default_factory=dict)   # command: extra environment variables

    def validate(self) -> None:
        if (self.entrypoint is None) == (self.command is None):
            raise ConfigError("set exactly one of 'entrypoint' (\"pkg.module:run\") or 'command' ([program, args...]).")
        if self.command is not None and not self.command:
            raise ConfigError("'command' is empty: give the program and its arguments, e.g. [python, agent.py].")
        positive("timeout_s", self.timeout_s)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    agent: AgentConfig | None = None     # train your own agent through the gateway instead of the agent loop
    output_dir: str = "runs/default"
    seed: int = 0

    def __post_init__(self) -> None:
        self.env.expand(self)
