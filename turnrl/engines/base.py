"""The engine protocol. Engines know nothing about chat templates: they deal only in token ids.

`logprobs[i]` is log softmax(logits / temperature)[token_i] of the distribution the token was sampled from,
before top-p/top-k truncation (temperature 0 means greedy; its logprobs are those of temperature 1). The
trainer recomputes the same quantity, so the two can be compared token by token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Iterable, Literal, Protocol

import torch

FinishReason = Literal["stop", "length", "abort", "interrupted"]   # interrupted: new weights (partial rollouts)


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None        # per-request seed: the same request samples the same tokens
    session: str | None = None     # the trajectory asking: a router keeps a session on one replica (prefix cache)

    def with_(self, **changes: Any) -> "Sampling":
        return replace(self, **changes)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    version: int | None = None     # the weight version that sampled these tokens (the oldest, if several did);
    #                                None: the engine does not say. "interrupted" completions were sampled by
    #                                this version alone, and the caller resumes them (turnrl.engines.resume)


@dataclass
class Delta:
    """Tokens just sampled, while the request goes on (`Engine.stream`)."""
    token_ids: list[int]
    logprobs: list[float]


class EngineError(RuntimeError):
    """An engine request failed; the agent loop records it on the trajectory."""


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond the required methods. Callers read this record; they never probe."""
    truncated_sampling: bool = True   # logprobs under top-p/top-k are still the full distribution's (see above)
    lora_adapters: bool = False       # `update_lora` loads a LoRA adapter as an adapter (no merge)
    sleep: bool = False               # `sleep`/`wake_up` free and restore device memory between rollouts
    partial_rollout: bool = False     # built with `partial_rollout=True`, a weight update interrupts the requests
    #                                   in flight: they return what they sampled, finish "interrupted"
    streaming: bool = False           # `stream` yields tokens as they are sampled (else the completion at once)


class Engine(Protocol):
    """The engine contract (tests/engines/test_contract.py runs it against every engine).

    Required: `generate`, `update_weights`, `close`. Declared with defaults in `EngineBase`: `capabilities`,
    `in_flight`, `stats`, `model`, `device`, `stream` (the tokens of one request as they are sampled, as `Delta`s,
    then its `Completion`; without `capabilities.streaming`, the completion alone), and `update_lora` / `sleep` /
    `wake_up`, which raise `EngineError`
    unless `capabilities` says the engine has them, `reset_prefix_cache` (a no-op without a cache), and
    `metrics` (the engine's own step metrics, e.g. a server engine's retries and revivals; none by default)."""
    capabilities: Capabilities
    in_flight: int                    # requests submitted and not yet answered (progress lines)
    stats: dict[str, Any]             # counters since the start (requests, tokens, ...)
    model: Any                        # the torch module when the engine holds one in this process, else None
    device: torch.device | None       # where `model` lives; None when the engine does not say
    max_model_len: int | None         # the longest sequence (prompt + completion) it serves; None: no own limit

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Completion: ...

    def stream(self, prompt_ids: list[int], sampling: Sampling) -> AsyncIterator[Delta | Completion]: ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    async def update_lora(self, adapter_tensors: dict[str, torch.Tensor], peft_config: dict[str, Any],
                          version: int) -> None: ...

    async def sleep(self, level: int = 1) -> None: ...

    async def wake_up(self) -> None: ...

    async def reset_prefix_cache(self) -> None: ...

    async def close(self) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class EngineBase:
    """The optional part of the `Engine` contract, declared once: an engine subclasses this and overrides what
    it has (and says so in `capabilities`)."""
    capabilities = Capabilities()
    in_flight = 0
    stats: dict[str, Any] = {}        # read-only default; an engine with counters assigns its own dict
    model: Any = None
    device: torch.device | None = None
    max_model_len: int | None = None

    async def stream(self, prompt_ids: list[int], sampling: Sampling) -> AsyncIterator[Delta | Completion]:
        yield await self.generate(prompt_ids, sampling)

    async def update_lora(self, adapter_tensors: dict[str, torch.Tensor], peft_config: dict[str, Any],
                          version: int) -> None:
        raise EngineError(f"{type(self).__name__} cannot load a LoRA adapter as an adapter "
                          "(capabilities.lora_adapters is false): send merged weights with update_weights")

    async def sleep(self, level: int = 1) -> None:
        raise EngineError(f"{type(self).__name__} has no sleep mode (capabilities.sleep is false)")

    async def wake_up(self) -> None:
        raise EngineError(f"{type(self).__name__} has no sleep mode (capabilities.sleep is false)")

    async def reset_prefix_cache(self) -> None:
        return None

    def metrics(self) -> dict[str, float]:
        """Counts since the last call, logged with each training step; most engines have none."""
        return {}
