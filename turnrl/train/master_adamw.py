"""AdamW over the fp32 masters that writes the 16-bit weights in the same pass (`trainer.optim.fused_master_step`).

With `trainer.param_dtype: bfloat16` (`turnrl.train.master`) an optimizer step is three passes over the
parameters on a GPU: torch's fused AdamW reads the fp32 gradients, divides them by the clip factor and writes
them back (its `grad_scale` contract), reads and writes the masters and both moments; then a multi-tensor copy
reads the masters again to write the bf16 weights. For Qwen2.5-0.5B's 494M parameters that is about 38 bytes a
parameter; the H200 profile of the bench's update (2026-12-07) spends 7.0 ms in the optimizer.

`MasterAdamW` is torch's AdamW (the same state, `state_dict`, schedule and fallbacks) whose step runs one Triton
kernel (`adamw_triton.adamw`) over every parameter, reached through tables of addresses: it reads the gradient,
master and moments once, writes master and moments, and rounds the new master into the weight: 30 bytes a
parameter, no gradient write-back, no copy kernel. The arithmetic is torch's fused AdamW's, in float32; the
moments' state (`exp_avg`, `exp_avg_sq`, a float32 `step` on the device) is what torch's fused AdamW keeps, so
checkpoints load into either. Where the kernel cannot run (CPU tensors, amsgrad, maximize, a tensor learning
rate, mixed dtypes, a closure) the step is torch's, followed by the weights' copy.
On an H100 (2026-12-08): the step 5.1 ms against 7.0 for torch's fused AdamW and the copy; the bench's update
1 ms faster. `trainer.optim.fused_master_step: auto` uses it wherever masters are stepped on a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from turnrl.train.batching import to_device

CHUNK = 1 << 16      # elements a program steps
BLOCK = 1024         # elements a program's loop step
_INTERPRET = False   # tests: run the kernel on CPU tensors (under Triton's interpreter)
_WEIGHTS = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _kernel() -> Any:
    from turnrl.train import adamw_triton
    return adamw_triton.adamw


def _tl(dtype: torch.dtype) -> Any:
    import triton.language as tl
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


class MasterAdamW(torch.optim.AdamW):
    """torch's AdamW over the masters of a `turnrl.train.master.MasterWeights` (which calls `write_weights_of`
    when attached), each step also writing the weights."""

    def write_weights_of(self, masters: list[torch.nn.Parameter], weights: list[torch.nn.Parameter],
                         push: Any) -> None:
        """The weight each master's step writes; `push`: the copy of every master into its weight (after a step
        the kernel could not take)."""
        self._weight_of = {id(m): w for m, w in zip(masters, weights)}
        self._push = push
        self._chunks: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        groups = [(group, [p for p in group["params"] if p.grad is not None]) for group in self.param_groups]
        if closure is None and getattr(self, "_weight_of", None) is not None and \
                all(self._runs(group, params) for group, params in groups):
            for group, params in groups:
                if params:
                    self._step(group, params)
            return None
        loss = super().step(closure)
        if getattr(self, "_push", None) is not None:
            self._push()
        return loss

    def _runs(self, group: dict[str, Any], params: list[torch.Tensor]) -> bool:
        if group["amsgrad"] or group["maximize"] or group.get("differentiable") or \
                isinstance(group["lr"], torch.Tensor) or getattr(self, "found_inf", None) is not None:
            return False
        weights = [self._weight_of.get(id(p)) for p in params]
        if any(w is None for w in weights):
            return False
        states = [self.state.get(p, {}) for p in params]
        aligned = all(t.data_ptr() % 16 == 0 for p, w, s in zip(params, weights, states)
                      for t in (p, p.grad, w, *(s[k] for k in ("exp_avg", "exp_avg_sq") if k in s)))
        return aligned and all((p.is_cuda or _INTERPRET) and p.dtype == torch.float32 and p.is_contiguous() and
                               p.grad.is_contiguous() and w.is_contiguous() and w.shape == p.shape and
                               w.device == p.device for p, w in zip(params, weights)) and \
            len({p.grad.dtype for p in params}) <= 1 and len({w.dtype for w in weights}) <= 1 and \
            all(w.dtype in _WEIGHTS for w in weights)

    def _chunk_tables(self, numels: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(tensor of each chunk, its first element) on `device`, kept per list of sizes."""
        key = tuple(numels)
        if key not in self._chunks:
            tensor, start = [], []
            for i, n in enumerate(numels):
                for first in range(0, n, CHUNK):
                    tensor.append(i)
                    start.append(first)
            self._chunks[key] = (to_device(torch.tensor(tensor, dtype=torch.int32), device),
                                 to_device(torch.tensor(start, dtype=torch.int64), device))
        return self._chunks[key]

    def _step(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        for p in params:   # torch's fused AdamW's state, made as its first step makes it
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        torch._foreach_add_([s["step"] for s in states], 1)
        weights = [self._weight_of[id(p)] for p in params]
        device = params[0].device
        table = to_device(torch.tensor(
            [[p.data_ptr() for p in params], [p.grad.data_ptr() for p in params],
             [s["exp_avg"].data_ptr() for s in states], [s["exp_avg_sq"].data_ptr() for s in states],
             [w.data_ptr() for w in weights], [s["step"].data_ptr() for s in states],
             [p.numel() for p in params]], dtype=torch.int64), device)
        chunk_tensor, chunk_start = self._chunk_tables([p.numel() for p in params], device)
        scale = getattr(self, "grad_scale", None)
        beta1, beta2 = group["betas"]
        _kernel()[(len(chunk_tensor),)](
            chunk_tensor, chunk_start, *table, scale if scale is not None else table[6], float(group["lr"]),
            float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]), HAS_SCALE=scale is not None,
            GRAD=_tl(params[0].grad.dtype), WEIGHT=_tl(weights[0].dtype), CHUNK=CHUNK, BLOCK=BLOCK,
            WIDEN=not params[0].is_cuda, num_warps=4)
