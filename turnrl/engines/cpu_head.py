"""The LM head of the embedded engine on a CPU: W @ x^T for the few rows of a decode step.

A decode step computes the logits of one token per running request, so the head is a [M, H] x [H, V]
product with M small and V large (SmolLM2: 49,152 x 576, 113 MB in float32). PyTorch's CPU `linear` runs
that shape at 6-11 GB/s on this repository's 2-core machine, while the same product computed as
W @ x^T (a [V, H] x [H, M] matmul over the transposed view) streams the weight at up to 39 GB/s:
M = 2: 22.4 ms -> 2.9 ms, M = 4: 16.6 -> 4.5, M = 8: 15.8 -> 7.0; from M = 12 on the two are close and
`linear` is kept. Only float32 was measured, so only float32 takes this path.

`use_skinny_head(model)` switches the model's output embedding (tied or not) to `SkinnyHead` in place: the
same parameters under the same names, so weight updates and state dicts do not change.
"""

from __future__ import annotations

from typing import Any

import torch

SKINNY_ROWS = 8


class SkinnyHead(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if not 0 < rows <= SKINNY_ROWS or x.device.type != "cpu" or x.dtype != torch.float32 \
                or self.weight.dtype != torch.float32:
            return super().forward(x)
        out = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).T).T.contiguous()
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.weight.shape[0])


def use_skinny_head(model: Any) -> bool:
    """Switch `model`'s output embedding to `SkinnyHead` if it is a plain `nn.Linear`; True if it did."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return False
    head.__class__ = SkinnyHead
    return True
