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

The suffixes of one micro-batch differ in length (a one-turn answer beside a four-turn one), so they run in
lanes: the rows sorted by suffix length and split into contiguous runs, each one decoder call padded to its
longest row, the split that minimises padded tokens plus a per-call cost (`suffix_lanes`). On a captured
step of the `wide` race work this computed 3,642 tokens instead of 5,136 (the suffixes alone: 2,118 padded
positions for 1,920 real ones, against 3,624 in one lane).
"""

from __future__ import annotations

from typing import Any

import torch

MIN_PREFIX = 32   # shorter shared prefixes are not worth a second forward call
# What one more decoder call (lane) costs, in padded tokens: on a CPU, where a row's forward and backward
# cost ~4.5 ms per token (SmolLM2-135M, fp32, 2 cores) and a call re-reads the weights (~0.1-0.3 s), 64.
# On a GPU a call is mostly fixed cost at these sizes: `benchmarks/lane_cost_probe.py` on an H100 (Qwen2.5-0.5B
# shape, 16 rows, bf16 autocast) put a lane at 200-10,000 suffix tokens, median ~5,000 (noisy), so a lane is
# split off only when it saves that many. Elsewhere, a middle value.
LANE_COST = {"cpu": 64, "cuda": 4096}
DEFAULT_LANE_COST = 1024


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


def suffix_lanes(lengths: list[int], lane_cost: int) -> list[list[int]]:
    """The positions of `lengths` split into lanes, each run as one decoder call padded to its longest row,
    that minimise padded tokens plus `lane_cost` per lane: the optimal split of the sorted lengths into
    contiguous runs (a dynamic programme, O(n^2) in the rows of one micro-batch)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best, cut = [0] + [None] * n, [0] * (n + 1)
    for i in range(1, n + 1):
        top = lengths[order[i - 1]]
        for j in range(i):
            cost = best[j] + (i - j) * top + lane_cost
            if best[i] is None or cost < best[i]:
                best[i], cut[i] = cost, j
    lanes, i = [], n
    while i > 0:
        lanes.append(order[cut[i]:i])
        i = cut[i]
    return lanes[::-1]


def lane_cost_for(device_type: str) -> int:
    return LANE_COST.get(device_type, DEFAULT_LANE_COST)


def shared_micro_batches(index: torch.Tensor, lengths: torch.Tensor, group: torch.Tensor, prefix: torch.Tensor,
                         token_budget: int, lane_cost: int = 0) -> list[tuple[torch.Tensor, int]]:
    """Split row indices into (rows, width) micro-batches whose computed tokens (each group's prefix once, then
    every row's suffix, padded within its lane) stay within the budget; a group's rows stay together unless
    they alone exceed it. Width is the longest row, as for `turnrl.train.batching.micro_batches`."""
    units: dict[int, list[int]] = {}
    for row in index.tolist():
        g = int(group[row])
        units.setdefault(g if g >= 0 else -1 - row, []).append(row)
    order = sorted(units.values(), key=lambda rows: -sum(int(lengths[r]) for r in rows))
    batches: list[list[int]] = []
    for rows in order:
        for part in _fit(rows, lengths, group, prefix, token_budget, lane_cost):
            if batches and _cost(batches[-1] + part, lengths, group, prefix, lane_cost) <= token_budget:
                batches[-1].extend(part)
            else:
                batches.append(list(part))
    return [(torch.tensor(rows, dtype=torch.long), max(int(lengths[r]) for r in rows)) for rows in batches]


def _fit(rows: list[int], lengths: torch.Tensor, group: torch.Tensor, prefix: torch.Tensor, budget: int,
         lane_cost: int) -> list[list[int]]:
    """One group's rows in parts that each fit the budget on their own (a part recomputes the prefix)."""
    parts: list[list[int]] = [[]]
    for r in rows:
        part = parts[-1] + [r]
        if parts[-1] and _cost(part, lengths, group, prefix, lane_cost) > budget:
            parts.append([r])
        else:
            parts[-1] = part
    return parts


def _cost(rows: list[int], lengths: torch.Tensor, group: torch.Tensor, prefix: torch.Tensor, lane_cost: int) -> int:
    """Tokens a micro-batch computes: each shared prefix once (padded to the longest), and the suffixes padded
    within their lanes."""
    prefixes = {int(group[r]): int(prefix[r]) for r in rows if int(prefix[r]) > 0}
    suffixes = [int(lengths[r]) - int(prefix[r]) for r in rows]
    padded = sum(len(lane) * max(suffixes[i] for i in lane) for lane in suffix_lanes(suffixes, lane_cost))
    return len(prefixes) * max(prefixes.values(), default=0) + padded


def shared_hidden(decoder: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  group: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states [B, T, H] for right-padded rows, each shared prefix computed once.
    Positions inside a row's prefix are 0 (nothing reads them); the rest equal a plain forward's."""
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
    cache = decoder(input_ids=input_ids[lead, :width], position_ids=positions, use_cache=True).past_key_values
    # 2. each row's suffix against its group's keys and values (a zero block, masked, for rows without one),
    #    in lanes of rows of similar suffix length so that short suffixes are not padded to the longest
    pick = torch.tensor([slots[g] if plen[r] > 0 else len(owners) for r, g in enumerate(group.tolist())], device=dev)
    padded = [(torch.cat([layer.keys, torch.zeros_like(layer.keys[:1])]),
               torch.cat([layer.values, torch.zeros_like(layer.values[:1])])) for layer in cache.layers]
    shared = prefix.to(dev)
    suffix_len = attention_mask.sum(1) - shared
    lanes = suffix_lanes(suffix_len.tolist(), lane_cost_for(dev.type))
    outs = [_suffix_lane(decoder, input_ids[rows], position_ids[rows], padded, pick[rows], shared[rows],
                         suffix_len[rows], width)
            for rows in (torch.tensor(lane, device=dev) for lane in lanes)]
    order = torch.tensor([r for lane in lanes for r in lane], device=dev)
    return torch.cat(outs)[torch.argsort(order)]


def _suffix_lane(decoder: Any, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 padded: list[tuple[torch.Tensor, torch.Tensor]], pick: torch.Tensor, shared: torch.Tensor,
                 suffix_len: torch.Tensor, width: int) -> torch.Tensor:
    """One lane's rows [n, T, H] in their own layout: their suffixes run against the prefix keys and values
    `pick` selects from `padded` (per layer; the last slot is the zero block of rows without a prefix)."""
    from transformers import DynamicCache

    dev = input_ids.device
    t = input_ids.shape[1]
    rows_cache = DynamicCache(config=decoder.config)
    for mine, (keys, values) in zip(rows_cache.layers, padded):
        keys, values = keys[pick], values[pick]
        mine.lazy_initialization(keys, values)
        mine.keys, mine.values = keys, values
    span = int(suffix_len.max())
    steps = torch.arange(span, device=dev)[None]
    source = (shared[:, None] + steps).clamp(max=t - 1)
    real = steps < suffix_len[:, None]
    past = torch.arange(width, device=dev)[None] < shared[:, None]
    mask = torch.cat([past, real], dim=1).long()
    positions = torch.where(shared[:, None] > 0, shared[:, None] + steps, position_ids.gather(1, source))
    hidden = decoder(input_ids=input_ids.gather(1, source), attention_mask=mask, position_ids=positions,
                     past_key_values=rows_cache, use_cache=True).last_hidden_state
    # back to the rows' own layout
    cols = torch.arange(t, device=dev)[None]
    back = (cols - shared[:, None]).clamp(0, span - 1)
    full = hidden.gather(1, back[..., None].expand(-1, -1, hidden.shape[-1]))
    return full * (cols >= shared[:, None])[..., None].to(full.dtype)
