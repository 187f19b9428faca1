"""The LM head of the embedded engine on a CPU: a decode step's 7-15 rows padded to 16.

A decode step computes the logits of one token per running request, so the head is a [M, H] x [H, V] product
with M small and V large (SmolLM2: 49,152 x 576, 113 MB in float32). On this repository's 2-core machine
(AMD EPYC, MKL through PyTorch 2.13) `linear`'s time for that shape is not monotonic in M: measured after
streaming the body's weights, as in a decode step (`python benchmarks/cpu_head_ab.py --sweep`,
benchmarks/results/cpu_head_sweep_2026-12-05.json), it takes 4.1-4.7 ms for 1-3 rows, 8.9-9.6 ms for 4-6,
13.3-22.7 ms for 7-15, and 9.6-11.2 ms again for 16-32 rows, where MKL switches to another kernel; 7-15 rows
padded to 16 take 9.4-9.9 ms. Padding them computes more and takes less time.
(An earlier version computed W @ x^T for up to 8 rows; measured in a decode step, that was slower than `linear`
for 2-6 rows, 45.8 against 36.6 ms a step at 2 rows, and 12-13 ms flat from 7 to 15.)
Only float32 was measured, so only float32 takes this path; the padded rows are zeros and are dropped.

`use_cpu_head(model)` switches the model's output embedding (tied or not) to `PaddedHead` in place: the
same parameters under the same names, so weight updates and state dicts do not change.
"""

from __future__ import annotations

from typing import Any

import torch

PAD_FROM, PAD_TO = 7, 16   # row counts in [PAD_FROM, PAD_TO) run as PAD_TO rows


class PaddedHead(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if not PAD_FROM <= rows < PAD_TO or x.device.type != "cpu" or x.dtype != torch.float32 \
                or self.weight.dtype != torch.float32:
            return super().forward(x)
        padded = x.new_zeros(PAD_TO, x.shape[-1])
        padded[:rows] = x.reshape(rows, x.shape[-1])
        out = super().forward(padded)[:rows]
        return out.view(*x.shape[:-1], self.weight.shape[0])


def use_cpu_head(model: Any) -> bool:
    """Switch `model`'s output embedding to `PaddedHead` if it is a plain `nn.Linear`; True if it did."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return False
    head.__class__ = PaddedHead
    return True
