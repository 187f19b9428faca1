"""Which rows each training rank runs, and in which micro-batches: planned once, on the driver.

A mini-batch's rows are dealt to the ranks by tokens, longest first, each to the rank with the fewest tokens so
far (greedy LPT scheduling: the busiest rank ends within one row of the mean). Each rank then cuts its share
into token-budget micro-batches exactly as the single-process trainer does (`turnrl.train.batching`).

FSDP runs collectives inside every forward and backward, so all ranks must run the same number of them: a rank
with fewer micro-batches than the busiest one runs dummy micro-batches (`None` in the plan), one short row with a
zero loss mask, whose gradients are zero.

The loss normalizer is the mini-batch's global token (or sequence) count, the same number on every rank and the
same as the single-process trainer's; FSDP averages gradients over ranks, so each rank scales its loss by the
world size (`normalizer / world`), and the sum over ranks is the one-big-batch gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from turnrl.train.batching import micro_batches


class MiniPlan(NamedTuple):
    """One optimizer step: the global normalizer and, per rank, its micro-batches (None: a dummy)."""
    normalizer: float
    micro: list[list[tuple[torch.Tensor, int] | None]]   # [rank][k] -> (row indices [b], width) or None


def assign_rows(index: torch.Tensor, lengths: torch.Tensor, ranks: int) -> list[torch.Tensor]:
    """Deal rows (`index`, [N]) to `ranks` ranks by tokens, longest first, to the least loaded rank."""
    load = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    order = index[torch.argsort(lengths[index], descending=True, stable=True)]
    for row in order.tolist():
        r = min(range(ranks), key=lambda k: (load[k], len(shares[k]), k))
        shares[r].append(row)
        load[r] += int(lengths[row])
    return [torch.tensor(sorted(s), dtype=torch.long) for s in shares]


def plan_mini(mini: torch.Tensor, lengths: torch.Tensor, loss_mask: torch.Tensor, ranks: int, token_budget: int,
              seq_mode: bool) -> MiniPlan:
    """Plan one mini-batch (rows `mini`) over `ranks` ranks; lengths [B], loss_mask [B, T]."""
    mask = loss_mask[mini]
    normalizer = float((mask.sum(1) > 0).sum()) if seq_mode else float(mask.sum())
    return MiniPlan(normalizer, plan_passes(mini, lengths, ranks, token_budget))


def plan_passes(rows: torch.Tensor, lengths: torch.Tensor, ranks: int, token_budget: int
                ) -> list[list[tuple[torch.Tensor, int] | None]]:
    """Per rank, its micro-batches of `rows`, padded with dummies (None) to the busiest rank's count."""
    per_rank: list[list[tuple[torch.Tensor, int] | None]] = []
    for share in assign_rows(rows, lengths, ranks):
        per_rank.append(list(micro_batches(share, lengths, token_budget)) if len(share) else [])
    most = max(len(m) for m in per_rank)
    for m in per_rank:
        m.extend([None] * (most - len(m)))
    return per_rank


def rank_tokens(plan: MiniPlan, lengths: torch.Tensor) -> list[int]:
    """Real tokens each rank processes in this mini-batch (the balance the plan reached)."""
    return [sum(int(lengths[i].sum()) for mb in micro if mb is not None for i in [mb[0]]) for micro in plan.micro]
