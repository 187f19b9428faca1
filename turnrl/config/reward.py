"""Rewards: `reward.*`, its LLM judge and the LLMs that judge or play users."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Literal

from turnrl.config.checks import positive
from turnrl.config.loader import ConfigError, secret


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
        positive("temperature", self.temperature, allow_zero=True)
        for name in ("max_tokens", "timeout_s", "max_concurrency", "backoff_s", "backoff_max_s"):
            positive(name, getattr(self, name))
        positive("retries", self.retries, allow_zero=True)


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
        positive("parse_retries", self.parse_retries, allow_zero=True)
        positive("max_conversation_chars", self.max_conversation_chars)
        positive("num_repeat_rollouts", self.num_repeat_rollouts, allow_zero=True)
        positive("max_future_turns", self.max_future_turns)
        positive("pass_timeout_s", self.pass_timeout_s)


@dataclass
class OverlongConfig:
    """DAPO's soft overlong punishment (turnrl/algo/dapo.py): 0 up to rollout.max_response_tokens - buffer
    response tokens, then linear down to -penalty at the limit; added to each trajectory's reward."""
    buffer: int = 0                      # tokens before the response limit where the penalty grows; 0 = off
    penalty: float = 1.0                 # the penalty at the limit (verl's penalty_factor)

    def validate(self) -> None:
        positive("buffer", self.buffer, allow_zero=True)
        positive("penalty", self.penalty, allow_zero=True)


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
