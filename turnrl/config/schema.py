"""The config tree: one dataclass per component.

Components never receive this tree; `cli.py` and the trainer unpack the fields they need into plain
arguments. Each dataclass validates its own values in `validate()` (called by the loader) and raises
`ConfigError` with the key and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from turnrl.config.loader import ConfigError, secret


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"'{name}' must be {'>= 0' if allow_zero else '> 0'}, got {value}.")


@dataclass
class LoraConfig:
    rank: int = 0                        # 0 = full fine-tuning
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"

    def validate(self) -> None:
        _positive("rank", self.rank, allow_zero=True)
        _positive("alpha", self.alpha)
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"'dropout' must be in [0, 1), got {self.dropout}.")


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"  # built-in alias, local HF dir, or cached hub id
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 where supported
    lora: LoraConfig = field(default_factory=LoraConfig)
    gradient_checkpointing: bool = False


VLLM_LORA_RANKS = (0, 1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class EngineConfig:
    kind: Literal["hf", "vllm"] = "hf"
    device: str = "auto"                 # auto | cpu | cuda | cuda:N  (hf engine)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_batch_size: int = 64             # hf: sequences decoded together
    gather_ms: float = 5.0               # hf: how long a batch waits for more requests
    seed: int = 0
    # vLLM
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    cpu_kv_cache_gb: float = 2.0         # vllm on CPU: KV cache size (GPU: gpu_memory_utilization)
    max_lora_rank: int = 0               # vllm: > 0 adds a LoRA slot so adapters sync alone (>= model.lora.rank)
    enable_sleep_mode: bool = False      # vllm on GPU: allow engine.sleep()/wake_up() to free GPU memory

    def validate(self) -> None:
        _positive("max_batch_size", self.max_batch_size)
        _positive("gather_ms", self.gather_ms, allow_zero=True)
        _positive("max_model_len", self.max_model_len)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("cpu_kv_cache_gb", self.cpu_kv_cache_gb)
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ConfigError(f"'max_lora_rank' must be one of {VLLM_LORA_RANKS} (0 = no LoRA slot; vLLM's sizes), "
                              f"got {self.max_lora_rank}.")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"'gpu_memory_utilization' must be in (0, 1], got {self.gpu_memory_utilization}.")


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 = off
    max_tokens_per_turn: int = 256

    def validate(self) -> None:
        _positive("temperature", self.temperature, allow_zero=True)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"'top_p' must be in (0, 1], got {self.top_p}.")
        _positive("top_k", self.top_k, allow_zero=True)
        _positive("max_tokens_per_turn", self.max_tokens_per_turn)


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
    tool_parser: str = "hermes"
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
            _positive(name, getattr(self, name))
        _positive("max_user_turns", self.max_user_turns, allow_zero=True)


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
        _positive("size", self.size)


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
        _positive("prompts_per_step", self.prompts_per_step)
        if self.eval is not None and self.eval.path is None and self.eval.task is None:
            raise ConfigError("'eval' needs 'path' (a JSONL/Parquet file) or 'task' (a built-in task).")


@dataclass
class RewardConfig:
    functions: list[str] = field(default_factory=list)   # built-in names or path.py:function
    weights: list[float] = field(default_factory=list)    # one per function; default 1.0 each
    use_tool_rewards: bool = True
    use_interaction_rewards: bool = True
    accuracy_part: str | None = None     # reward part read as accuracy (default: first function, else interaction)

    def validate(self) -> None:
        if self.weights and len(self.weights) != len(self.functions):
            raise ConfigError(f"'weights' has {len(self.weights)} entries for {len(self.functions)} functions.")


@dataclass
class AlgoConfig:
    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"] = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    turn_level: bool = False             # per-turn discounted returns instead of one broadcast reward
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    kl_coef: float = 0.0
    kl_type: Literal["k1", "k2", "k3", "mse", "low_var_kl"] = "low_var_kl"
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    tis_cap: float | None = None         # truncated importance sampling for engine/trainer mismatch
    value_clip: float = 0.2
    value_coef: float = 0.5

    def validate(self) -> None:
        _positive("clip_low", self.clip_low)
        _positive("clip_high", self.clip_high)
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"'dual_clip' must be > 1 (e.g. 3.0), got {self.dual_clip}.")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ConfigError("'gamma' and 'lam' must be in [0, 1].")
        _positive("kl_coef", self.kl_coef, allow_zero=True)
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ConfigError(f"'tis_cap' must be >= 1, got {self.tis_cap}.")


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0

    def validate(self) -> None:
        _positive("lr", self.lr)
        if len(self.betas) != 2:
            raise ConfigError(f"'betas' must have two numbers, got {self.betas}.")


@dataclass
class TrainerConfig:
    steps: int = 10
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    optim: OptimConfig = field(default_factory=OptimConfig)
    epochs_per_step: int = 1             # PPO epochs over each rollout batch
    mini_batches: int = 1                # optimizer steps per epoch
    micro_batch_tokens: int = 4096       # token budget of one forward/backward
    save_every: int = 0                  # 0 = only at the end
    keep_checkpoints: int = 2
    eval_every: int = 0
    resume: str | None = None            # "latest" or a checkpoint directory
    log_every: int = 1
    trajectories_per_step_saved: int = 16

    def validate(self) -> None:
        _positive("steps", self.steps)
        _positive("epochs_per_step", self.epochs_per_step)
        _positive("mini_batches", self.mini_batches)
        _positive("micro_batch_tokens", self.micro_batch_tokens)
        _positive("save_every", self.save_every, allow_zero=True)
        _positive("eval_every", self.eval_every, allow_zero=True)


@dataclass
class SFTConfig:
    """Supervised fine-tuning on conversations (and rejection-sampling rounds); uses trainer.optim etc."""
    epochs: int = 1
    batch_size: int = 16                 # conversations per optimizer step
    max_length: int = 2048               # longer conversations are skipped and counted
    rounds: int = 0                      # > 0: rejection sampling: collect -> filter -> SFT, this many times
    prompts_per_round: int = 32
    min_reward: float = 1.0              # acceptance threshold for rejection sampling
    export_dir: str | None = None        # the merged final model (default OUTPUT_DIR/model)

    def validate(self) -> None:
        _positive("epochs", self.epochs)
        _positive("batch_size", self.batch_size)
        _positive("max_length", self.max_length)
        _positive("rounds", self.rounds, allow_zero=True)
        _positive("prompts_per_round", self.prompts_per_round)


@dataclass
class LoggingConfig:
    sinks: list[Literal["console", "tensorboard", "wandb", "mlflow"]] = field(default_factory=lambda: ["console"])
    project: str = "turnrl"
    run_name: str | None = None
    wandb_api_key: str | None = secret()
    progress: Literal["auto", "on", "off"] = "auto"


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
    output_dir: str = "runs/default"
    seed: int = 0
