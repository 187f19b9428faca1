"""Shared-prefix training: the prompt that a group's samples share runs once per micro-batch, not once per row.

The n samples of a GRPO group start with the same prompt, and in agentic tasks that prompt (system prompt,
tool schemas, examples) is often most of each row: on the built-in calculator task ~360 of ~430 tokens. A
causal model's hidden states over a prefix do not depend on what follows, so the trainer can run each shared
prefix once, keep its keys and values (with their autograd graph), and run every row's own suffix against
them. Gradients flow back through the shared keys and values into the one prefix pass, so the update equals
the one over full rows (`tests/train/test_shared_prefix.py` checks logprobs and gradients).

The prefix of a row is everything before the position whose hidden state the first loss token needs (that
is, its first policy token's position minus one): no loss token and no needed state lies inside it. Rows
whose prefixes are identical token for token form a group; a group of one row, or one whose prefix is short,
runs as a plain row. Micro-batches keep a group's rows together and count what is computed: each prefix once
plus the padded suffixes.
"""

from __future__ import annotations

from typing import Any

import torch

MIN_PREFIX = 32   # shorter shared prefixes are not worth a second forward call


def prefix_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  loss_mask: torch.Tensor, min_prefix: int = MIN_PREFIX) -> tuple[torch.Tensor, torch.Tensor]:
    """(group [B], prefix [B]) on the CPU: rows with the same group id >= 0 share their first prefix[r] tokens;
    group -1 / prefix 0: the row runs whole. Rows must be right-padded with positions 0, 1, ... to share."""
    ids, mask, pos, loss = (t.cpu() for t in (input_ids, attention_mask, position_ids, loss_mask))
    lengths = mask.sum(1)
    keys: dict[bytes, list[int]] = {}
    prefix = torch.zeros(ids.shape[0], dtype=torch.long)
    for r in range(ids.shape[0]):
        n = int(lengths[r])
        hits = loss[r, :n].nonzero()
        if not len(hits) or not bool((pos[r, :n] == torch.arange(n)).all()) or not bool(mask[r, :n].all()):
            continue
        length = int(hits[0]) - 1
        if length >= min_prefix:
            prefix[r] = length
            keys.setdefault(ids[r, :length].numpy().tobytes(), []).append(r)
    group = torch.full((ids.shape[0],), -1, dtype=torch.long)
    for g, rows in enumerate(r for r in keys.values() if len(r) > 1):
        group[rows] = g
    prefix[group < 0] = 0
    return group, prefix


def shared_micro_batches(index: torch.Tensor, lengths: torch.Tensor, group: torch.Tensor, prefix: torch.Tensor,
                         token_budget: int) -> list[tuple[torch.Tensor, int]]:
    """Split row indices into (rows, width) micro-batches whose computed tokens (each group's prefix once, then
    every row's padded suffix) stay within the budget; a group's rows stay together unless they alone exceed
    it. Width is the longest row, as for `turnrl.train.batching.micro_batches`."""
    units: dict[int, list[int]] = {}
    for row in index.tolist():
        g = int(group[row])
        units.setdefault(g if g >= 0 else -1 - row, []).append(row)
    order = sorted(units.values(), key=lambda rows: -sum(int(lengths[r]) for r in rows))
    batches: list[list[int]] = []
    for rows in order:
        for part in _fit(rows, lengths, prefix, token_budget):
            if batches and _cost(batches[-1] + part, lengths, group, prefix) <= token_budget:
                batches[-1].extend(part)
            else:
                batches.append(list(part))
    return [(torch.tensor(rows, dtype=torch.long), max(int(lengths[r]) for r in rows)) for rows in batches]


def _fit(rows: list[int], lengths: torch.Tensor, prefix: torch.Tensor, budget: int) -> list[list[int]]:
    """One group's rows in parts that each fit the budget on their own (a part recomputes the prefix)."""
    parts: list[list[int]] = [[]]
    for r in rows:
        part = parts[-1] + [r]
        shared = int(prefix[r])
        cost = shared + len(part) * max(int(lengths[x]) - shared for x in part)
        if parts[-1] and cost > budget:
            parts.append([r])
        else:
            parts[-1] = part
    return parts


def _cost(rows: list[int], lengths: torch.Tensor, group: torch.Tensor, prefix: torch.Tensor) -> int:
    prefixes = {int(group[r]): int(prefix[r]) for r in rows if int(prefix[r]) > 0}
    suffix = max(int(lengths[r]) - int(prefix[r]) for r in rows)
    return len(prefixes) * max(prefixes.values(), default=0) + len(rows) * suffix


def shared_hidden(decoder: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  group: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states [B, T, H] for right-padded rows, each shared prefix computed once.
    Positions inside a row's prefix are 0 (nothing reads them); the rest equal a plain forward's."""
    from transformers import DynamicCache

    dev = input_ids.device
    b, t = input_ids.shape
    plen = prefix.tolist()
    owners: dict[int, int] = {}                      # group -> its first row in this micro-batch
    for r, g in enumerate(group.tolist()):
        if plen[r] > 0:
            owners.setdefault(g, r)
    slots = {g: i for i, g in enumerate(owners)}
    width = max(plen)
    lead = torch.tensor(list(owners.values()), device=dev)
    # 1. every shared prefix once; right padding needs no mask under causal attention
    positions = torch.arange(width, device=dev).expand(len(owners), width)
    out = decoder(input_ids=input_ids[lead, :width], position_ids=positions, use_cache=True)
    # 2. each row's suffix against its group's keys and values (a zero block, masked, for rows without one)
    cache = out.past_key_values
    pick = torch.tensor([slots[g] if plen[r] > 0 else len(owners) for r, g in enumerate(group.tolist())], device=dev)
    rows_cache = DynamicCache(config=decoder.config)
    for mine, theirs in zip(rows_cache.layers, cache.layers):
        keys = torch.cat([theirs.keys, torch.zeros_like(theirs.keys[:1])])[pick]
        values = torch.cat([theirs.values, torch.zeros_like(theirs.values[:1])])[pick]
        mine.lazy_initialization(keys, values)
        mine.keys, mine.values = keys, values
    shared = prefix.to(dev)
    suffix_len = attention_mask.sum(1) - shared
    span = int(suffix_len.max())
    steps = torch.arange(span, device=dev)[None]
    source = (shared[:, None] + steps).clamp(max=t - 1)
    real = steps < suffix_len[:, None]
    past = torch.arange(width, device=dev)[None] < shared[:, None]
    mask = torch.cat([past, real], dim=1).long()
    positions = torch.where(shared[:, None] > 0, shared[:, None] + steps, position_ids.gather(1, source))
    hidden = decoder(input_ids=input_ids.gather(1, source), attention_mask=mask, position_ids=positions,
                     past_key_values=rows_cache, use_cache=True).last_hidden_state
    # 3. back to the rows' own layout
    cols = torch.arange(t, device=dev)[None]
    back = (cols - shared[:, None]).clamp(0, span - 1)
    full = hidden.gather(1, back[..., None].expand(-1, -1, hidden.shape[-1]))
    return full * (cols >= shared[:, None])[..., None].to(full.dtype)
