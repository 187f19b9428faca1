"""Mini-batches and token-budget micro-batches over a padded `Batch`.

Rows are grouped into micro-batches whose padded size (rows x longest row) stays within a token budget,
longest rows first, and each micro-batch is cut to its own longest row, so memory grows with the budget,
not with the longest row of the whole batch, and short rows carry little padding. A row longer than the
budget gets a micro-batch of its own. Packed micro-batches (`turnrl.train.packing`) carry no padding: there the
budget counts real tokens, and rows fill micro-batches first-fit, longest first.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class Rows:
    """Per-row training tensors ([B, T] unless noted); a slice of them is a micro-batch."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor       # trainer logprobs before the update (the PPO ratio's denominator)
    engine_logprobs: torch.Tensor    # what the engine reported while sampling
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None

    def select(self, index: torch.Tensor, width: int | None = None) -> "Rows":
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                out[f.name] = None
                continue
            value = value[index]
            out[f.name] = value[:, :width] if width is not None else value
        return Rows(**out)

    @property
    def lengths(self) -> torch.Tensor:  # [B]
        return self.attention_mask.sum(dim=1)


def to_device(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`; to a GPU through pinned memory, without waiting for the GPU's queue (a plain
    copy synchronizes with it, so the CPU could not run ahead into the next micro-batch)."""
    if device.type != "cuda" or index.device.type != "cpu":
        return index.to(device)
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
