"""The training rows (`Rows`, built from trajectories by `to_rows`), mini-batches and token-budget micro-batches.

Rows are grouped into micro-batches whose padded size (rows x longest row) stays within a token budget,
longest rows first, and each micro-batch is cut to its own longest row, so memory grows with the budget,
not with the longest row of the whole batch, and short rows carry little padding. A row longer than the
budget gets a micro-batch of its own. Packed micro-batches (`turnrl.train.packing`) carry no padding: there the
budget counts real tokens, and rows fill micro-batches first-fit, longest first.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from turnrl.ledger import Segment, Source, Trajectory


@dataclass
class Rows:
    """The training container: one row per trajectory segment (`to_rows`), right-padded; token i's values sit
    at column i. Tensors are [B, T] unless noted; a slice of them (`select`) is a mini- or micro-batch."""
    input_ids: torch.Tensor          # long
    attention_mask: torch.Tensor     # long, 1 on real tokens
    position_ids: torch.Tensor       # long, 0, 1, ... on real tokens, 0 on padding
    loss_mask: torch.Tensor          # float, 1 on trained policy tokens (all 0 on a masked trajectory's rows)
    old_logprobs: torch.Tensor       # float, trainer logprobs before the update (the PPO ratio's denominator)
    engine_logprobs: torch.Tensor    # float, what the engine reported while sampling (0 off policy tokens)
    advantages: torch.Tensor         # float
    ref_logprobs: torch.Tensor | None = None   # float, the reference policy's (a KL term)
    returns: torch.Tensor | None = None        # float, value targets (GAE)
    old_values: torch.Tensor | None = None     # float, the critic's values before the update (GAE)
    token_rewards: torch.Tensor | None = None  # float, rewards on the last policy token of their turn or row
    turn_ids: torch.Tensor | None = None       # long, each token's assistant turn
    traj_index: torch.Tensor | None = None     # [B] long, the trajectory of each row (rows in trajectory order)

    def select(self, index: torch.Tensor, width: int | None = None) -> "Rows":
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                out[f.name] = None
                continue
            value = value[index]
            out[f.name] = value[:, :width] if width is not None and value.dim() == 2 else value
        return Rows(**out)

    def to(self, device: torch.device) -> "Rows":
        moved = Rows(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                        for f in fields(self)})
        if self.attention_mask.device.type == "cpu":   # counted here, free: the update never reads them back
            counts = self.host()
            moved._host = HostCounts(counts.lengths, counts.tokens, counts.selected, moved.attention_mask,
                                     moved.loss_mask)
        return moved

    @property
    def lengths(self) -> torch.Tensor:  # [B]
        return self.attention_mask.sum(dim=1)

    def host(self) -> "HostCounts":
        """Each row's length and loss-mask sum on the host, kept: counted on the CPU when `to` moved the rows,
        else read from the device once (one sync). Kept while `attention_mask` and `loss_mask` are the same
        tensors (a field set anew is counted again; the rows are never edited in place)."""
        kept = self.__dict__.get("_host")
        if kept is None or kept.attention_mask is not self.attention_mask or kept.loss_mask is not self.loss_mask:
            both = torch.stack([self.attention_mask.sum(1).double(), self.loss_mask.double().sum(1),
                                (self.loss_mask[:, 1:] > 0).sum(1).double()]).cpu()
            kept = self._host = HostCounts(both[0].long(), both[1], both[2].long(), self.attention_mask,
                                           self.loss_mask)
        return kept


@dataclass(frozen=True)
class HostCounts:
    """`Rows.host()`: per-row counts on the CPU, so batching and loss normalizers need no device sync."""
    lengths: torch.Tensor          # [B] long, real tokens
    tokens: torch.Tensor           # [B] float64, the loss mask's sum (trained policy tokens)
    selected: torch.Tensor         # [B] long, policy tokens after column 0 (what the fused head computes)
    attention_mask: torch.Tensor   # the tensors they were counted from
    loss_mask: torch.Tensor

    def normalizer(self, index: torch.Tensor, seq_mode: bool) -> float:
        """The loss normalizer of the rows `index` (CPU): their policy tokens, or with `seq_mode` the number
        of rows that have any."""
        tokens = self.tokens[index]
        return float((tokens > 0).sum()) if seq_mode else float(tokens.sum())

    def selected_in(self, index: torch.Tensor) -> int:
        """`forward_logprobs`' `selected` for the rows `index` (CPU)."""
        return int(self.selected[index].sum())


SMALL_COPY_BYTES = 1 << 16   # up to this size a copy to the GPU goes from pageable memory (see `to_device`)


def to_device(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`, without waiting for the GPU's queue (a plain copy synchronizes with it, so the
    CPU could not run ahead into the next micro-batch). A small tensor goes from pageable memory as an
    asynchronous copy, which the driver stages at once; a larger one through pinned memory first (H100 profiles
    of the update: pinning cost 0.5-1.3 ms a call whatever the size, more than the copy of a few indices)."""
    if device.type != "cuda" or index.device.type != "cpu":
        return index.to(device)
    if index.numel() * index.element_size() <= SMALL_COPY_BYTES:
        return index.to(device, non_blocking=True)
    return index.pin_memory().to(device, non_blocking=True)


def micro_batches(index: torch.Tensor, lengths: torch.Tensor, token_budget: int,
                  packed: bool = False) -> list[tuple[torch.Tensor, int]]:
    """Split row indices into micro-batches of at most `token_budget` padded tokens (`packed`: real tokens):
    (rows, width) pairs, width the longest row of the micro-batch."""
    order = index[torch.argsort(lengths[index], descending=True, stable=True)]
    groups: list[tuple[list[int], int]] = []
    if packed:
        filled: list[int] = []
        for row in order.tolist():
            length = int(lengths[row])
            slot = next((k for k, used in enumerate(filled) if used + length <= token_budget), None)
            if slot is None:
                groups.append(([row], length))
                filled.append(length)
            else:
                groups[slot][0].append(row)
                filled[slot] += length
        return [(torch.tensor(rows, dtype=torch.long), width) for rows, width in groups]
    for row in order.tolist():
        length = int(lengths[row])
        if groups:
            rows, width = groups[-1]
            if (len(rows) + 1) * width <= token_budget:  # rows come longest first: width stays
                rows.append(row)
                continue
        groups.append(([row], length))
    return [(torch.tensor(rows, dtype=torch.long), width) for rows, width in groups]


def mini_batches(n_rows: int, n_mini: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A seeded shuffle of the rows split into `n_mini` nearly equal parts."""
    perm = torch.randperm(n_rows, generator=generator)
    return [part for part in torch.tensor_split(perm, min(n_mini, max(n_rows, 1))) if len(part)]


def to_rows(trajectories: list[Trajectory], turn_rewards: bool = False, pad_id: int = 0) -> Rows:
    """Pad every segment of `trajectories` into `Rows` (on the CPU), in trajectory order.

    The engine's logprobs are also the first `old_logprobs` (until a trainer pass replaces them); advantages
    start at 0. Rewards: the trajectory reward (the total, step rewards included) sits on the last policy
    token of its last segment that has one. With `turn_rewards`, each turn's step reward sits on that turn's
    last policy token instead and only the rest of the total (the outcome part) on the last one, so the rows
    still sum to the total. Masked trajectories keep their rows, with a zero loss mask.
    """
    index = [(ti, si) for ti, t in enumerate(trajectories) for si in range(len(t.segments))]
    width = max((len(trajectories[ti].segments[si]) for ti, si in index), default=0)
    B = len(index)
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    attention = torch.zeros((B, width), dtype=torch.long)
    loss_mask = torch.zeros((B, width))
    engine_lp = torch.zeros((B, width))
    token_rewards = torch.zeros((B, width))
    turn_ids = torch.zeros((B, width), dtype=torch.long)
    traj_index = torch.zeros(B, dtype=torch.long)
    # The outcome goes on the last policy token of the trajectory: in its last segment that has one (a split
    # can leave a final segment that holds only the re-rendered history, e.g. when the budget ran out).
    outcome_segment = {ti: max((si for si, seg in enumerate(t.segments) if _last_policy_index(seg) >= 0),
                               default=len(t.segments) - 1) for ti, t in enumerate(trajectories)}
    for row, (ti, si) in enumerate(index):
        traj, seg = trajectories[ti], trajectories[ti].segments[si]
        n = len(seg)
        input_ids[row, :n] = torch.tensor(seg.token_ids, dtype=torch.long)
        attention[row, :n] = 1
        if not traj.masked:
            loss_mask[row, :n] = torch.tensor(seg.loss_mask, dtype=torch.float)
        engine_lp[row, :n] = torch.tensor(seg.logprobs)
        turn_ids[row, :n] = torch.tensor(seg.turns, dtype=torch.long)
        traj_index[row] = ti
        outcome = traj.reward
        if turn_rewards:
            for t in traj.turns:
                if t.segment == si and t.end > t.start:
                    token_rewards[row, t.end - 1] += t.reward
            outcome -= sum(t.reward for t in traj.turns if t.end > t.start)
        if si == outcome_segment[ti]:
            last = _last_policy_index(seg)
            if last >= 0:
                token_rewards[row, last] += outcome
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0) * attention
    return Rows(input_ids, attention, positions, loss_mask, engine_lp.clone(), engine_lp, torch.zeros_like(loss_mask),
                token_rewards=token_rewards, turn_ids=turn_ids, traj_index=traj_index)


def _last_policy_index(seg: Segment) -> int:
    for i in range(len(seg.sources) - 1, -1, -1):
        if seg.sources[i] == Source.POLICY:
            return i
    return -1
