"""The config tree: one dataclass per component.

Components never receive this tree; `cli.py` and the trainer unpack the fields they need into plain
arguments. Each dataclass validates its own values in `validate()` (called by the loader) and raises
`ConfigError` with the key and the fix.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

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
    # keys that once existed and did nothing: an old config that sets one learns what to do instead (the loader)
    removed_keys: ClassVar[dict[str, str]] = {
        "dtype": "set trainer.dtype (training) and engine.dtype (sampling) instead"}
    name: str = "smollm2-135m-instruct"  # built-in alias, local HF dir, or cached hub id
    lora: LoraConfig = field(default_factory=LoraConfig)
    gradient_checkpointing: bool = False
    chat_template: str | None = None     # a Jinja file replacing the tokenizer's chat template (none: the model's)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # template variables, e.g. enable_thinking

    def validate(self) -> None:
        if self.chat_template is not None and not Path(self.chat_template).expanduser().is_file():
            raise ConfigError(f"'chat_template' must be the path of a Jinja chat template file, got "
                              f"{self.chat_template!r} (no such file).")


VLLM_LORA_RANKS = (0, 1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class EngineConfig:
    kind: Literal["hf", "vllm", "vllm_server"] = "hf"
    device: str = "auto"                 # auto | cpu | cuda | cuda:N  (hf engine)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_batch_size: int = 64             # hf: sequences decoded together
    gather_ms: float = 5.0               # hf: how long a batch waits for more requests
    seed: int = 0
    prefix_cache_tokens: int = 32768     # hf (plain engine): KV of up to this many tokens kept for reuse by later
    #                                      turns and sibling samples (0 or enable_prefix_caching=false: off)
    fast: Literal["auto", "on", "off"] = "auto"  # hf: the fast engine (slot KV cache of max_batch_size x
    #                                      max_model_len, CUDA graphs, device sampling); auto: on CUDA
    fast_prefix_cache: bool = True       # hf fast engine: later turns continue their parked slot, groups copy the
    #                                      prompt KV (9x fewer prefilled tokens; multi-turn phase 1.14 s against
    #                                      1.58 s without, H100: README "Prefix cache in the fast engine")
    fast_admission_graphs: bool = False  # hf fast engine with CUDA graphs: admissions padded to buckets, one
    #                                      graph launch each (turnrl/engines/fast/admit.py); off by default: on H100s
    #                                      the padding slowed the offline phase ~0.3 s and the multi-turn one did
    #                                      not gain (README "Admissions as CUDA graphs"); false: eager, exact sizes
    exact: bool = False                  # hf: engine and trainer logprobs equal bit for bit, tokens independent of
    #                                      the batch (batch-invariant forward of turnrl/exact; slot engine, eager)
    gc_freeze: bool = True               # once the engine is built, and after the first step or warm-up, the
    #                                      process's live objects leave the garbage collector's full collections
    #                                      (gc.freeze; turnrl/observe/gc_heap.py): no 0.1-0.3 s pauses of all threads
    partial_rollout: bool = False        # with trainer.async_rollout: a weight sync interrupts the requests in
    #                                      flight, which go on from their sampled tokens on the new weights
    #                                      (turnrl/engines/resume.py; hf, fast, vllm, vllm_server)
    # vLLM
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    cpu_kv_cache_gb: float = 2.0         # vllm on CPU: KV cache size (GPU: gpu_memory_utilization)
    max_num_seqs: int = 0                # vllm: sequences scheduled together (0: vLLM's default, 128 here); the
    #                                      rest of rollout.concurrency waits in vLLM's queue
    cpu_threads: int = 0                 # vllm on CPU (in-process): the engine's threads (0: the trainer's torch
    #                                      threads, since rollout and update take turns; 1 where other work
    #                                      shares the cores during rollout)
    max_lora_rank: int = 0               # vllm: > 0 adds a LoRA slot so adapters sync alone (>= model.lora.rank)
    enable_sleep_mode: bool = False      # vllm on GPU: allow engine.sleep()/wake_up() to free GPU memory
    # Ray (trainer.placement colocated/split)
    replicas: int = 0                    # engine replicas, each an actor on tensor_parallel_size GPUs (0: auto)
    request_retries: int = 2             # a request whose replica died is retried on another this many times
    # vLLM servers (kind vllm_server; README "Rolling out on vLLM servers")
    urls: list[str] = field(default_factory=list)  # running servers (python -m turnrl.engines.vllm_launch ...)
    launch: int = 0                      # > 0: turnrl starts this many servers itself (instead of urls)
    launch_timeout_s: float = 600.0
    served_model_name: str = "turnrl-policy"
    transfer_dir: str = ""               # where weight files for the servers go ("" = /dev/shm); shared storage
    #                                      when a server runs on another host
    request_timeout_s: float = 600.0
    revive_timeout_s: float = 600.0      # how long a restarted server may take to come back

    def validate(self) -> None:
        if self.kind == "vllm_server" and bool(self.urls) == bool(self.launch):
            raise ConfigError("engine.kind=vllm_server needs either engine.urls (running servers) or engine.launch "
                              "(how many servers turnrl starts), not both" if self.urls else
                              "engine.kind=vllm_server needs engine.urls=[http://host:port, ...] (running servers) "
                              "or engine.launch=N (turnrl starts N servers)")
        if self.kind != "vllm_server" and (self.urls or self.launch):
            raise ConfigError(f"engine.urls and engine.launch are for engine.kind=vllm_server, not {self.kind!r}")
        _positive("launch", self.launch, allow_zero=True)
        _positive("request_timeout_s", self.request_timeout_s)
        _positive("max_batch_size", self.max_batch_size)
        _positive("gather_ms", self.gather_ms, allow_zero=True)
        _positive("prefix_cache_tokens", self.prefix_cache_tokens, allow_zero=True)
        _positive("max_model_len", self.max_model_len)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("cpu_kv_cache_gb", self.cpu_kv_cache_gb)
        _positive("max_num_seqs", self.max_num_seqs, allow_zero=True)
        _positive("replicas", self.replicas, allow_zero=True)
        _positive("request_retries", self.request_retries, allow_zero=True)
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ConfigError(f"'max_lora_rank' must be one of {VLLM_LORA_RANKS} (0 = no LoRA slot; vLLM's sizes), "
                              f"got {self.max_lora_rank}.")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"'gpu_memory_utilization' must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.exact and (self.kind != "hf" or self.fast == "off"):
            raise ConfigError("'exact' needs the embedded slot engine, whose forward the trainer shares: set "
                              "kind: hf and fast: auto or on (vLLM's kernels cannot match the trainer's bit for "
                              "bit; keep exact: false there and watch the mismatch/* metrics).")


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
class LLMConfig:
    """An LLM that judges or plays a user: an OpenAI-compatible endpoint or a frozen local copy of a model."""
    backend: Literal["openai", "local"] = "openai"
    model: str = ""                      # openai: the served model name; local: a model spec (alias, HF dir)
    base_url: str = "http://127.0.0.1:8000/v1"   # openai: up to /v1
    api_key: str | None = secret()       # openai: env:NAME or file:PATH (never the key itself); none: no key
    temperature: float = 0.0
    max_tokens: int = 256
    timeout_s: float = 60.0              # per attempt
    max_concurrency: int = 8             # calls in flight (local: sequences decoded together)
    retries: int = 3                     # extra attempts on 429, 5xx, timeouts, refused connections
    backoff_s: float = 0.5               # first retry waits about this long, doubling each time
    backoff_max_s: float = 8.0
    cache: bool = True                   # reuse answers to identical requests (temperature 0 only)
    cache_path: str | None = None        # also keep them in this JSONL file across runs
    extra_body: dict[str, Any] = field(default_factory=dict)   # openai: extra request fields (top_p, ...)
    engine: Literal["hf", "vllm"] = "hf"  # local: the engine kind
    device: str = "cpu"                  # local
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # local
    seed: int = 0                        # local

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("'model' is required: the served model name (openai) or a model spec such as "
                              "smollm2-135m-instruct (local).")
        if self.backend == "openai" and not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"'base_url' must start with http:// or https://, got {self.base_url!r}.")
        if self.api_key and not self.api_key.startswith(("env:", "file:")):
            raise ConfigError("'api_key' must refer to the key, not hold it: env:NAME (an environment variable) or "
                              "file:PATH (a file holding it).")
        _positive("temperature", self.temperature, allow_zero=True)
        for name in ("max_tokens", "timeout_s", "max_concurrency", "backoff_s", "backoff_max_s"):
            _positive(name, getattr(self, name))
        _positive("retries", self.retries, allow_zero=True)


# The LLM judge's built-in metrics (turnrl.rewards.judge, turnrl.rewards.collab): judged by the LLM, or computed.
JUDGED_METRICS = {
    "accuracy": "is the assistant's final answer or deliverable correct, and does it meet the user's goal "
                "(compare with the reference answer when there is one)? 1 = fully correct, 0 = wrong or missing.",
    "interactivity": "did the assistant engage with the user: ask about what was missing or ambiguous, use "
                     "the user's answers, stay on the user's goal, keep replies short and clear? "
                     "1 = very engaging and helpful, 0 = ignored the user.",
}
COMPUTED_METRICS = {
    "token_amount": "tokens the policy wrote in the conversation (prompt excluded): weight it negatively "
                    "to ask for brevity, e.g. -0.0005.",
    "bleu": "BLEU-4 (smoothed) of the final assistant message against the row's ground truth text, 0..1.",
    "pass_rate": "share of the row's tests (extra.tests, else ground_truth) that the last code block of the "
                 "final assistant message passes, run in a Python subprocess. Not a sandbox: use only "
                 "on machines where running model-written code is acceptable.",
}


@dataclass
class JudgeConfig:
    """An LLM judge as a reward, optionally on sampled future conversations (CollabLLM).

    score = sum over metrics m of clamp(w_m * mean over conversations of m, -1, 1). The conversations are the
    trajectory itself, or with `num_repeat_rollouts` > 0 that many futures: the conversation continued by the
    policy and the row's simulated user for up to `max_future_turns` assistant turns (not trained on).
    Metrics: accuracy, interactivity (judged, 0..1), token_amount (assistant tokens), bleu (final answer vs
    ground truth, 0..1), pass_rate (share of the row's tests the final code passes), and your own judged ones
    from `metrics`.
    """
    llm: LLMConfig | None = None         # needed when a judged metric has a weight
    metric_weights: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)  # your own judged metrics: name -> what 1 and 0 mean
    rubric: str | None = None            # a prompt template file with {conversation} (default: built-in)
    json_prefill: bool = False           # start the judge's reply with '{"<metric>": ' (helps small models)
    parse_retries: int = 1               # re-asks after a reply that is not valid score JSON
    max_conversation_chars: int = 12000  # longer conversations lose their middle in the judge prompt
    weight: float = 1.0                  # of this reward in the total
    num_repeat_rollouts: int = 0         # futures per trajectory (0: judge the trajectory as it is)
    max_future_turns: int = 2            # assistant turns in each future
    pass_timeout_s: float = 10.0         # pass_rate: per test run

    def validate(self) -> None:
        if not self.metric_weights:
            raise ConfigError("'metric_weights' is empty: give each metric a weight, e.g. "
                              "{accuracy: 1.0, interactivity: 0.5, token_amount: -0.0005}.")
        clash = sorted(set(self.metrics) & (set(JUDGED_METRICS) | set(COMPUTED_METRICS)))
        if clash:
            raise ConfigError(f"'metrics' redefines built-in metric(s) {clash}; pick other names.")
        valid = [*JUDGED_METRICS, *COMPUTED_METRICS, *self.metrics]
        for name in self.metric_weights:
            if name not in valid:
                close = difflib.get_close_matches(name, valid, n=1)
                hint = f" Did you mean '{close[0]}'?" if close else ""
                raise ConfigError(f"'metric_weights.{name}': unknown metric.{hint} Valid: {', '.join(valid)} "
                                  "(define your own judged metric under 'metrics: {name: description}').")
        judged = [m for m in self.metric_weights if m not in COMPUTED_METRICS]
        if judged and self.llm is None:
            raise ConfigError(f"metric(s) {judged} are judged by an LLM: set 'llm' (backend, model, ...).")
        _positive("parse_retries", self.parse_retries, allow_zero=True)
        _positive("max_conversation_chars", self.max_conversation_chars)
        _positive("num_repeat_rollouts", self.num_repeat_rollouts, allow_zero=True)
        _positive("max_future_turns", self.max_future_turns)
        _positive("pass_timeout_s", self.pass_timeout_s)


@dataclass
class OverlongConfig:
    """DAPO's soft overlong punishment (turnrl/algo/dapo.py): 0 up to rollout.max_response_tokens - buffer
    response tokens, then linear down to -penalty at the limit; added to each trajectory's reward."""
    buffer: int = 0                      # tokens before the response limit where the penalty grows; 0 = off
    penalty: float = 1.0                 # the penalty at the limit (verl's penalty_factor)

    def validate(self) -> None:
        _positive("buffer", self.buffer, allow_zero=True)
        _positive("penalty", self.penalty, allow_zero=True)


@dataclass
class RewardConfig:
    functions: list[str] = field(default_factory=list)   # built-in names or path.py:function
    weights: list[float] = field(default_factory=list)    # one per function; default 1.0 each
    function_kwargs: list[dict[str, Any]] = field(default_factory=list)  # one per function: extra keyword arguments
    use_tool_rewards: bool = True
    use_interaction_rewards: bool = True
    accuracy_part: str | None = None     # reward part read as accuracy (default: first function, else interaction)
    judge: JudgeConfig | None = None     # an LLM judge / CollabLLM conversation-level reward, part 'judge'
    overlong: OverlongConfig = field(default_factory=OverlongConfig)  # DAPO overlong reward shaping

    def validate(self) -> None:
        if self.weights and len(self.weights) != len(self.functions):
            raise ConfigError(f"'weights' has {len(self.weights)} entries for {len(self.functions)} functions.")
        if self.function_kwargs and len(self.function_kwargs) != len(self.functions):
            raise ConfigError(f"'function_kwargs' has {len(self.function_kwargs)} entries for {len(self.functions)} "
                              "functions (one mapping per function, {} for none).")


@dataclass
class RolloutCorrectionConfig:
    """Engine/trainer mismatch correction (turnrl/algo/rollout_correction.py): truncated IS weights, rejection
    of tokens or sequences whose ratio pi_trainer / pi_engine leaves [rs_low, rs_high], and a veto."""
    is_level: Literal["token", "sequence"] | None = None   # IS weights min(ratio, is_cap) per token / sequence
    is_cap: float = 2.0
    rs_level: Literal["token", "sequence", "geometric"] | None = None   # rejection statistic
    rs_high: float | None = None         # keep ratios <= rs_high (required with rs_level)
    rs_low: float | None = None          # keep ratios >= rs_low (default 1 / rs_high)
    veto: float | None = None            # reject a sequence holding a token with ratio < veto (e.g. 1e-4)

    def validate(self) -> None:
        _positive("is_cap", self.is_cap)
        if self.rs_level is not None and (self.rs_high is None or self.rs_high <= 0):
            raise ConfigError(f"'rs_level: {self.rs_level}' needs 'rs_high' > 0 (e.g. 2.0; rs_low defaults to "
                              "1 / rs_high).")
        if self.rs_low is not None and (self.rs_low <= 0 or (self.rs_high is not None and self.rs_low > self.rs_high)):
            raise ConfigError(f"need 0 < rs_low <= rs_high, got rs_low={self.rs_low}, rs_high={self.rs_high}.")
        if self.veto is not None:
            _positive("veto", self.veto)


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling (turnrl/train/dynamic_sampling.py): drop groups whose samples all score the same
    and sample more prompts until the step has data.prompts_per_step groups with signal."""
    enable: bool = False
    metric: str = "reward"               # reward | accuracy | the name of a reward part
    max_rounds: int = 4                  # rollout rounds per step, the first included (0: no limit)
    prompts_per_round: int | None = None  # prompts each round samples (default data.prompts_per_step)

    def validate(self) -> None:
        _positive("max_rounds", self.max_rounds, allow_zero=True)
        if self.prompts_per_round is not None:
            _positive("prompts_per_round", self.prompts_per_round)


LOSS_MODES = ("ppo", "gspo", "cispo", "gmpo")


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
    loss_mode: Literal["ppo", "gspo", "cispo", "gmpo"] = "ppo"   # policy loss (turnrl/algo/policy_losses.py)
    correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)

    def validate(self) -> None:
        _positive("clip_low", self.clip_low)
        if self.loss_mode in ("gspo", "gmpo") and self.loss_agg == "token-mean":
            raise ConfigError(f"loss_mode {self.loss_mode} averages per sequence, then over sequences: set "
                              "'loss_agg' to seq-mean-token-mean.")
        if self.loss_mode != "ppo" and self.dual_clip is not None:
            raise ConfigError(f"'dual_clip' is PPO's; loss_mode {self.loss_mode} does not use it: set it to null.")
        if self.loss_mode == "ppo" and self.clip_low >= 1:
            raise ConfigError(f"'clip_low' must be < 1 with loss_mode ppo, got {self.clip_low}.")
        if self.tis_cap is not None and self.correction.is_level is not None:
            raise ConfigError("'tis_cap' is token-level IS: set either it or 'correction.is_level'/'is_cap', not "
                              "both.")
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
    removed_keys: ClassVar[dict[str, str]] = {"log_every": "metrics are logged every step; remove the key"}
    steps: int = 10
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    optim: OptimConfig = field(default_factory=OptimConfig)
    epochs_per_step: int = 1             # PPO epochs over each rollout batch
    mini_batches: int = 1                # optimizer steps per epoch
    micro_batch_tokens: int = 4096       # token budget of one forward/backward
    fused_head: Literal["auto", "on", "off"] = "auto"  # chunked logprobs of policy tokens only, no full logits
    #                                      (auto = on; off: the model's own logits path)
    compile: bool = False                # torch.compile each decoder layer (GPU)
    packing: bool = False                # micro-batches as packed rows, no padding (GPU: varlen flash attention)
    shared_prefix: bool = True           # a group's shared prompt runs once per micro-batch (not with packing or
    #                                      gradient checkpointing; exact: turnrl/train/shared_prefix.py)
    retain_host_memory: bool = True      # CPU training: malloc keeps freed memory (no page faults per micro-batch)
    save_every: int = 0                  # 0 = only at the end
    keep_checkpoints: int = 2
    eval_every: int = 0
    resume: str | None = None            # "latest" or a checkpoint directory
    overwrite: bool = False              # a new run into an output_dir holding one deletes it (else: an error)
    trajectories_per_step_saved: int = 16
    max_masked_steps: int = 3            # stop after this many steps in a row with every trajectory masked (0: never)
    # Scale-out on Ray (turnrl/distributed): local = this process only
    placement: Literal["local", "colocated", "split"] = "local"  # colocated: engines share the trainer's GPUs
    nodes: int = 1
    gpus_per_node: int | None = None     # None: the Ray cluster's GPUs / nodes (0: CPU actors, gloo)
    ranks: int = 0                       # training ranks (0: colocated every GPU, split the GPUs engines leave, CPU 1)
    ray_address: str | None = None       # an existing cluster (ray://... or host:port); None: start Ray here
    cpus_per_actor: float = 1.0
    weight_sync: Literal["auto", "object_store", "broadcast", "ipc"] = "auto"
    async_rollout: bool = False          # engines sample step k+1 while the trainer updates on step k
    max_staleness: int = 1               # async: a batch trains at most this many policy versions after sampling
    carry_over: int = 0                  # async: a batch closes once prompts_per_step groups finished; the rest
    #                                      run on into the next batches, at most this many (staleness + this)

    def validate(self) -> None:
        _positive("steps", self.steps)
        _positive("epochs_per_step", self.epochs_per_step)
        _positive("mini_batches", self.mini_batches)
        _positive("micro_batch_tokens", self.micro_batch_tokens)
        _positive("save_every", self.save_every, allow_zero=True)
        _positive("eval_every", self.eval_every, allow_zero=True)
        _positive("nodes", self.nodes)
        if self.gpus_per_node is not None:
            _positive("gpus_per_node", self.gpus_per_node, allow_zero=True)
        _positive("ranks", self.ranks, allow_zero=True)
        _positive("cpus_per_actor", self.cpus_per_actor)
        _positive("max_staleness", self.max_staleness, allow_zero=True)
        _positive("carry_over", self.carry_over, allow_zero=True)
        if self.carry_over and not self.async_rollout:
            raise ConfigError("'carry_over' lets groups run on while the trainer updates: set 'async_rollout: true' "
                              "(placement split) or 'carry_over: 0'.")
        _positive("max_masked_steps", self.max_masked_steps, allow_zero=True)
        if self.packing and self.placement != "local":
            raise ConfigError("'packing' runs in the local trainer only: set 'packing' to false with placement "
                              f"{self.placement}.")
        if self.placement == "local" and (self.async_rollout or self.nodes > 1 or self.ranks > 1):
            raise ConfigError("'async_rollout', 'nodes' > 1 and 'ranks' > 1 run on Ray: set 'placement' to split "
                              "(engines and trainer on their own GPUs) or colocated.")
        if self.async_rollout and self.placement == "colocated":
            raise ConfigError("'async_rollout' needs engines that keep running while the trainer updates: set "
                              "'placement: split' (colocated engines sleep during updates).")
        if self.async_rollout and self.max_staleness < 1:
            raise ConfigError("'max_staleness' must be >= 1 with 'async_rollout' (0 is the synchronous loop).")


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
        _positive("timeout_s", self.timeout_s)


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
