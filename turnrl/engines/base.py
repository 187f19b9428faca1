"""The engine protocol. Engines know nothing about chat templates: they deal only in token ids.

`logprobs[i]` is log softmax(logits / temperature)[token_i] of the distribution the token was sampled from,
before top-p/top-k truncation (temperature 0 means greedy; its logprobs are those of temperature 1). The
trainer recomputes the same quantity, so the two can be compared token by token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Literal, Protocol

import torch

FinishReason = Literal["stop", "length", "abort"]


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


class EngineError(RuntimeError):
    """An engine request failed; the agent loop records it on the trajectory."""


class Engine(Protocol):
    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Completion: ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    async def close(self) -> None: ...
