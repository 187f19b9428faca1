"""AdamW with linear warmup and a constant or cosine schedule; the step with gradient clipping."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from turnrl.config.schema import OptimConfig
from turnrl.train.master import MasterWeights
from turnrl.train.master_adamw import MasterAdamW


def lr_lambda(warmup: int, total: int, schedule: str, min_ratio: float) -> Callable[[int], float]:
    def fn(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if schedule == "cosine":
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0
    return fn


def build_optimizer(params: list[torch.nn.Parameter], o: OptimConfig, total_steps: int,
                    master: MasterWeights | None = None) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over `params` and its schedule; with `master` (`params` are then its fp32 masters) each step is
    followed by the copy of the masters into the bf16 weights, or on GPUs, unless `o.fused_master_step` is off,
    writes them itself (`turnrl.train.master_adamw`)."""
    if not params:
        raise ValueError("the model has no trainable parameters")
    fused = all(p.is_cuda for p in params)  # one kernel for all parameters on GPUs
    steps_masters = master is not None and fused
    if o.fused_master_step == "on" and not steps_masters:
        raise ValueError("trainer.optim.fused_master_step=on steps fp32 masters of 16-bit weights on a GPU, and here "
                         f"{'the parameters are not on a GPU' if master is not None else 'the weights are fp32'}: "
                         "set it to auto (on where it applies) or off")
    kind = MasterAdamW if steps_masters and o.fused_master_step != "off" else torch.optim.AdamW
    optimizer = kind(params, lr=o.lr, betas=(o.betas[0], o.betas[1]), weight_decay=o.weight_decay,
                     fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(o.warmup_steps, total_steps, o.schedule, o.min_lr_ratio))
    if master is not None:
        master.attach(optimizer)
    return optimizer, scheduler


def clip_and_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                  max_norm: float) -> torch.Tensor:
    """Scale the gradients of `params` to a total norm of at most `max_norm` (<= 0: no clipping), step, and
    return the norm before clipping (on the device: nothing waits for it). A fused AdamW divides the gradients
    by the clip factor in its own kernel (`grad_scale`, AMP's unscaling hook), one pass over the gradients
    fewer than `clip_grad_norm_`'s multiply; any other optimizer gets `clip_grad_norm_` first."""
    fused = all(group.get("fused") for group in optimizer.param_groups)
    if not fused or getattr(optimizer, "grad_scale", None) is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        optimizer.step()
        return norm
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if max_norm > 0:   # clip_grad_norm_ multiplies by min(1, max_norm / (norm + 1e-6)); the kernel divides
        optimizer.grad_scale = torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)
    try:
        optimizer.step()
    finally:
        optimizer.__dict__.pop("grad_scale", None)
    return norm
