"""Partial rollouts: a request that new weights interrupted goes on from the tokens it already sampled.

An engine built with `partial_rollout=True` (`engine.partial_rollout`, for `trainer.async_rollout`) does not
let a weight update wait for the requests in flight, nor lets them continue on a KV cache the old weights
computed: at the update it interrupts every running request, which returns the tokens sampled so far under
the old weights (finish reason "interrupted", with that version). `generate` sends the prompt plus those
tokens again, for the tokens still allowed, and joins the pieces. The new weights prefill the whole context
themselves, so every token is sampled by exactly one policy given its whole prefix (the scheme of AReaL's
interruptible generation and slime's partial rollouts; verl's async mode instead lets the old weights finish),
and the engine logprob recorded for each token is that policy's, which the rollout correction and the PPO
ratio then use token by token.

`Sampled.versions` says which weights sampled which tokens: spans `(offset, version)` over the completion's
tokens, in order (one span when nothing interrupted it, or when the engine does not say: version None). A
resumed piece samples with its own seed, derived from the request's seed and the piece's index, so a rollout
stays reproducible given where the interruptions fell.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import AsyncIterator

from turnrl.engines.base import Completion, Delta, Engine, EngineError, Sampling

MAX_PIECES = 64   # interruptions one request survives (one per weight update while it runs)


@dataclass
class Sampled:
    completion: Completion
    versions: list[tuple[int, int | None]] = field(default_factory=list)   # (offset into token_ids, version)
    interruptions: int = 0


def piece_seed(seed: int | None, piece: int) -> int | None:
    if seed is None or piece == 0:
        return seed
    return (seed * 1_000_003 + piece * 7_919) & 0x7FFFFFFF


class _Joined:
    """The pieces of one request so far."""

    def __init__(self, prompt_ids: list[int], sampling: Sampling):
        self.prompt, self.sampling = list(prompt_ids), sampling
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[tuple[int, int | None]] = []

    def next_request(self, piece: int) -> tuple[list[int], Sampling]:
        if piece > MAX_PIECES:
            raise EngineError(f"a request was interrupted {MAX_PIECES + 1} times in a row (one weight update "
                              "each): the engine interrupts without new weights")
        s = self.sampling
        return self.prompt + self.ids, s.with_(max_tokens=s.max_tokens - len(self.ids), seed=piece_seed(s.seed, piece))

    def add(self, part: Completion, piece: int) -> Sampled | None:
        """Join `part`; the whole request once it has ended (None: it was interrupted, resume it)."""
        if part.token_ids and (not self.versions or self.versions[-1][1] != part.version):
            self.versions.append((len(self.ids), part.version))
        self.ids += part.token_ids
        self.logprobs += part.logprobs
        reason = part.finish_reason
        if reason == "interrupted" and self.ids and self.ids[-1] in self.sampling.stop_token_ids:
            reason = "stop"
        elif reason == "interrupted" and len(self.ids) >= self.sampling.max_tokens:
            reason = "length"
        if reason == "interrupted":
            return None
        oldest = min((v for _, v in self.versions if v is not None), default=part.version)
        return Sampled(Completion(self.ids, self.logprobs, reason, oldest), self.versions or [(0, part.version)],
                       piece)


async def generate(engine: Engine, prompt_ids: list[int], sampling: Sampling) -> Sampled:
    """`engine.generate`, resumed across interruptions until the request stops, runs out of tokens or aborts."""
    joined = _Joined(prompt_ids, sampling)
    for piece in itertools.count():
        done = joined.add(await engine.generate(*joined.next_request(piece)), piece)
        if done is not None:
            return done
    raise AssertionError("unreachable")


async def stream(engine: Engine, prompt_ids: list[int], sampling: Sampling) -> AsyncIterator[Delta | Sampled]:
    """`engine.stream`, resumed the same way: the tokens of every piece as they come, then the whole request."""
    joined = _Joined(prompt_ids, sampling)
    for piece in itertools.count():
        async for item in engine.stream(*joined.next_request(piece)):
            if isinstance(item, Delta):
                yield item
                continue
            done = joined.add(item, piece)
            if done is not None:
                yield done
                return
