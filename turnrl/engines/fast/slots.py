"""Which KV slot a request goes to, and which cached tokens it can reuse (the fast engine's prefix cache).

Every slot of the fast engine holds the KV of one token sequence at positions [0, len). A slot is:

- **occupied**: a running request; its prompt's KV (written at admission) never changes while it runs, so
  other requests may copy it (a GRPO group's samples share their prompt this way);
- **parked**: a finished request's prompt and sampled tokens, kept for the trajectory's next turn, whose
  prompt extends them. A parked slot is reused in place: the next turn prefills only its new tokens;
- **empty**.

A new request looks for the slot sharing the longest prefix with its prompt (at least `min_match` tokens,
and at most all but its last token: the last one is fed to get the next-token logits). It goes into that
slot when the slot is parked, or into a free slot with the shared KV copied there when the slot is running.
The search goes through an index of chained hashes of each slot's `min_match`-token blocks (as vLLM's block
hashes): a prompt's blocks are looked up until one is missing, and only the slots holding the deepest one
found are compared token by token (so a hash collision can cost a match, never a wrong one).
Parked slots are reused least recently used first when no empty slot is left (that is the eviction: the cache
is the slots' preallocated memory). A request that shares more blocks with another request of the same
admission than with any slot waits for the next one (a step later, once), so that the other's prompt is
prefilled once.

Content is tracked on the host only (token ids); the KV moves on the device in `FastEngine`. Weight updates
drop everything cached: KV computed under the old weights is never reused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from turnrl.engines.prefix_cache import common_prefix


class Match(NamedTuple):
    query: np.ndarray | None   # the prompt as an array (None without a cache)
    hashes: list[int]          # its block hashes
    depth: int                 # how many of them the index holds
    slot: int | None           # the slot sharing the longest prefix (None: no usable match)
    length: int                # tokens shared with it (what a plan would not prefill)


@dataclass(frozen=True)
class Plan:
    slot: int                  # where the request goes
    start: int                 # tokens of its prompt already in that slot (after the copy, if any)
    source: int | None = None  # a running slot to copy positions [0, start) from


def block_hashes(tokens: np.ndarray, upto: int, block: int) -> list[int]:
    """Chained hashes of tokens[:block], tokens[:2 * block], ... up to `upto` tokens."""
    out, h = [], 0
    for end in range(block, upto + 1, block):
        h = hash((h, tokens[end - block:end].tobytes()))
        out.append(h)
    return out


class SlotTable:
    """Host-side bookkeeping of the slots' token content; `enabled=False` is the engine without a cache."""

    def __init__(self, slots: int, enabled: bool = True, min_match: int = 16):
        self.slots, self.enabled, self.min_match = slots, enabled, min_match
        self.empty = list(range(slots))              # kept sorted: the lowest slot first (small decode batches)
        self.parked: OrderedDict[int, np.ndarray] = OrderedDict()   # slot -> tokens, least recently used first
        self.running: dict[int, np.ndarray] = {}     # occupied slot -> its prompt (a copy source), if current
        self.stats = {"prefix_hit_tokens": 0, "prefix_hits": 0, "prefix_copies": 0, "parked_reuses": 0,
                      "evicted": 0, "deferred": 0}
        self._index: dict[int, set[int]] = {}        # block hash -> slots (running or parked) holding that prefix
        self._hashes: dict[int, list[int]] = {}      # slot -> its content's block hashes
        self._batch: list[tuple[np.ndarray | None, Plan]] = []   # the admission being formed
        self._pending: set[int] = set()              # block hashes of the prompts in `_batch`
        self._sources: set[int] = set()
        self._vacate: set[int] = set()               # parked slots this admission moves down (freed on commit)

    def _hold(self, slot: int, tokens: np.ndarray) -> None:
        self._forget(slot)
        self._hashes[slot] = block_hashes(tokens, len(tokens), self.min_match)
        for h in self._hashes[slot]:
            self._index.setdefault(h, set()).add(slot)

    def _forget(self, slot: int) -> None:
        for h in self._hashes.pop(slot, ()):
            holders = self._index.get(h)
            if holders is not None:
                holders.discard(slot)
                if not holders:
                    del self._index[h]

    def _depth(self, hashes: list[int], table: Any) -> int:
        """How many leading blocks of a prompt `table` holds (each block's hash implies those before it)."""
        depth = 0
        while depth < len(hashes) and hashes[depth] in table:
            depth += 1
        return depth

    # -- admission -----------------------------------------------------------------------------------
    def available(self) -> int:
        """Slots a new request could take now (empty, or parked and not a source of this admission)."""
        return len(self.empty) + len([s for s in self.parked if s not in self._sources])

    def match(self, prompt: list[int]) -> Match:
        """The slot holding the longest prefix of `prompt` that a plan made now would reuse (changes nothing)."""
        query = np.asarray(prompt, dtype=np.int64) if self.enabled else None   # no cache: no copy of the prompt
        cap = len(prompt) - 1
        best, best_len, depth = None, 0, 0
        hashes: list[int] = []
        if self.enabled and cap >= self.min_match:
            hashes = block_hashes(query, cap, self.min_match)
            depth = self._depth(hashes, self._index)
            if depth:
                holders = sorted(self._index[hashes[depth - 1]], key=lambda slot: slot not in self.parked)
                for slot in holders[:8]:
                    tokens = self.parked[slot] if slot in self.parked else self.running[slot]
                    shared = min(common_prefix(tokens, query), cap)
                    if shared > best_len:
                        best, best_len = slot, shared
            if best_len < self.min_match:
                best, best_len = None, 0
        return Match(query, hashes, depth, best, best_len)

    def plan(self, prompt: list[int], may_wait: bool = True, found: Match | None = None) -> Plan | None:
        """Place `prompt` in the admission being formed; None: it waits for the next admission (see above;
        only when `may_wait`). The caller checks `available()` first; `found`: `match(prompt)`, if it was
        just made (nothing changed since)."""
        query, hashes, depth, best, best_len = found if found is not None else self.match(prompt)
        if may_wait and hashes and self._depth(hashes, self._pending) > depth:
            self.stats["deferred"] += 1
            return None
        if best is not None and best in self.parked:
            del self.parked[best]
            self._forget(best)
            self.stats["parked_reuses"] += 1
            plan = Plan(best, best_len)
            if self.empty and self.empty[0] < best:   # move down: decode steps cover slots [0, highest running]
                plan = Plan(self.empty.pop(0), best_len, source=best)
                self._vacate.add(best)
        else:
            target = self._free_slot()
            if target is None:
                return None
            plan = Plan(target, best_len, best if best is not None else None)
            if best is not None:
                self._sources.add(best)
                self.stats["prefix_copies"] += 1
        if best_len:
            self.stats["prefix_hits"] += 1
            self.stats["prefix_hit_tokens"] += best_len
        self._batch.append((query, plan))
        self._pending.update(hashes)
        return plan

    def _free_slot(self) -> int | None:
        if self.empty:
            return self.empty.pop(0)
        for slot in self.parked:                       # least recently used first
            if slot not in self._sources:
                del self.parked[slot]
                self._forget(slot)
                self.stats["evicted"] += 1
                return slot
        return None

    def cancel(self) -> None:
        """Forget the admission being formed: its slots go back (used when the requests could not start)."""
        for slot in [plan.slot for _, plan in self._batch] + list(self._vacate):
            self._release(slot)
        self._batch, self._sources, self._pending, self._vacate = [], set(), set(), set()

    def commit(self, reuse: bool = True) -> list[Plan]:
        """The admission's plans, in order; their slots now run their prompts. `reuse` False: the cached KV
        the plans counted on is stale (new weights), so each prefills its whole prompt in its slot."""
        plans = [plan if reuse else Plan(plan.slot, 0) for _, plan in self._batch]
        for tokens, plan in self._batch:
            self._forget(plan.slot)                  # a parked slot taken over, or an evicted one
            if self.enabled:
                self.running[plan.slot] = tokens
                self._hold(plan.slot, tokens)
        for slot in self._vacate:                    # their KV is copied before the next admission can take them
            self._release(slot)
        self._batch, self._sources, self._pending, self._vacate = [], set(), set(), set()
        return plans

    # -- when requests end ---------------------------------------------------------------------------
    def finished(self, slot: int, tokens: list[int] | None) -> None:
        """A slot's request ended; `tokens` (its prompt and the sampled tokens whose KV is in the slot) parks it,
        None frees it (aborted, failed, or computed under weights that have changed since)."""
        current = self.running.pop(slot, None) is not None
        if self.enabled and tokens is not None and current and len(tokens) >= self.min_match:
            self.parked[slot] = np.asarray(tokens, dtype=np.int64)
            self._hold(slot, self.parked[slot])
        else:
            self._release(slot)

    def _release(self, slot: int) -> None:
        self._forget(slot)
        self.running.pop(slot, None)
        self.parked.pop(slot, None)
        if slot not in self.empty:
            self.empty.append(slot)
            self.empty.sort()

    def drop_cached(self) -> None:
        """New weights: parked slots become empty and running prompts stop being copy sources."""
        for slot in list(self.parked):
            self._release(slot)
        for slot in list(self.running):
            self._forget(slot)
        self.running.clear()

    def reset(self) -> None:
        self.empty, self._batch, self._sources, self._pending = list(range(self.slots)), [], set(), set()
        self._vacate = set()
        self.parked.clear()
        self.running.clear()
        self._index.clear()
        self._hashes.clear()
