"""A prefix KV cache for the embedded engine: later turns and sibling samples skip recomputing shared context.

In a multi-turn rollout, turn k+1's prompt is turn k's prompt, its sampled tokens and the tool or user delta;
the n samples of a GRPO group share their whole first prompt. The engine keeps the KV of finished requests and
of prefilled prompts here, keyed by their tokens, and a new request reuses the longest common prefix it shares
with any entry (a causal model's KV of a prefix does not depend on what follows it), so only the rest is
prefilled. An entry that also holds the next-token logits serves an identical prompt with no forward at all.

Entries are kept least-recently-used first out under a token budget and dropped on every weight update.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Entry:
    tokens: np.ndarray                 # [L] int64: the tokens whose KV is held
    keys: list[torch.Tensor]           # per layer [H, L, D]
    values: list[torch.Tensor]         # per layer [H, L, D]
    logits: torch.Tensor | None = None  # [V] float32: next-token logits after `tokens`, if known

    def __len__(self) -> int:
        return len(self.tokens)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    """Token-keyed KV entries under a budget of `max_tokens` cached tokens (LRU eviction)."""

    def __init__(self, max_tokens: int, min_match: int = 16):
        if max_tokens < 1:
            raise ValueError(f"prefix cache budget must be positive, got {max_tokens}")
        self.max_tokens = max_tokens
        self.min_match = min_match
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self.cached_tokens = 0
        self.stats = {"lookups": 0, "hits": 0, "exact_hits": 0, "hit_tokens": 0, "evicted": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `prompt`, and how many of its tokens to reuse.

        The reusable length is capped at len(prompt) - 1 (the last prompt token must be fed to get logits)
        unless the entry matches the whole prompt and holds its next-token logits (an exact hit)."""
        self.stats["lookups"] += 1
        query = np.asarray(prompt, dtype=np.int64)
        best, best_len = None, 0
        for key, entry in self._entries.items():
            shared = common_prefix(entry.tokens, query)
            exact = shared == len(query) == len(entry) and entry.logits is not None
            usable = shared if exact else min(shared, len(query) - 1)
            if usable > best_len:
                best, best_len = (key, entry), usable
        if best is None or best_len < self.min_match:
            return None, 0
        self._entries.move_to_end(best[0])
        self.stats["hits"] += 1
        self.stats["hit_tokens"] += best_len
        self.stats["exact_hits"] += int(best_len == len(query))
        return best[1], best_len

    def store(self, entry: Entry | None) -> None:
        """Add an entry; entries it extends are dropped (it serves every prefix they could)."""
        if entry is None or len(entry) < self.min_match or len(entry) > self.max_tokens:
            return
        key = entry.tokens.tobytes()
        old = self._entries.pop(key, None)
        if old is not None:
            self.cached_tokens -= len(old)
            if entry.logits is None:
                entry.logits = old.logits
        for other_key in [k for k, e in self._entries.items()
                          if len(e) < len(entry) and common_prefix(e.tokens, entry.tokens) == len(e)]:
            self.cached_tokens -= len(self._entries.pop(other_key))
        self._entries[key] = entry
        self.cached_tokens += len(entry)
        while self.cached_tokens > self.max_tokens:
            _, dropped = self._entries.popitem(last=False)
            self.cached_tokens -= len(dropped)
            self.stats["evicted"] += 1

    def clear(self) -> None:
        self._entries.clear()
        self.cached_tokens = 0
