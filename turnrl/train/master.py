"""bf16 weights to compute with, fp32 master weights to train (`trainer.param_dtype`).

With `bfloat16` the models hold bf16 copies of their float parameters and the optimizer steps fp32 masters,
the recipe the distributed ranks already run (FSDP2 `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`), here on one device:
- every float parameter is cast to bf16; buffers (rotary frequencies) stay as they are;
- every trainable one has an fp32 master, which the optimizer, gradient clipping and checkpoints see;
- each backward's bf16 gradients are summed into the masters' fp32 gradients (a post-accumulate-grad hook),
  so micro-batches sum in fp32: a master without a gradient yet holds the bf16 one until the backward ends,
  when all of them become fp32 in one multi-tensor copy (one kernel per ~dozens of tensors instead of one per
  parameter: on an H100, 290 casts took 2.7 ms of a 0.32 s update); later micro-batches add into them;
- after each optimizer step the masters are copied (rounded to nearest) into the bf16 weights.
Against fp32 weights under autocast, the tensors between the matmuls (residual stream, norms, their
gradients) move half the bytes and no weight is cast again per micro-batch; the matmuls were bf16 already.
`auto` is this recipe on CUDA under bf16 autocast (an H100's update ran 2-3% faster than with fp32 weights,
2026-12-07) and FSDP2's bf16 on GPU ranks; fp32 weights on CPUs.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["MasterWeights", "master_weights", "resolve_param_dtype", "cast_weights"]


def resolve_param_dtype(param_dtype: str, amp: torch.dtype | None, exact: torch.dtype | None = None,
                        device: torch.device | None = None) -> torch.dtype:
    """The dtype the models compute with (the local trainer's, and the Ray ranks' FSDP2 param_dtype through
    `turnrl.distributed.ranks.rank_param_dtype`): bf16 for `bfloat16`, and for `auto` on a CUDA `device` under
    bf16 autocast without `engine.exact` (the update ran 2-3% faster with bf16 weights on an H100, either
    attention, and 5-6% with the Triton attention too); else fp32. Raises where `bfloat16` cannot hold."""
    if param_dtype == "auto":
        cuda = device is not None and device.type == "cuda"
        return torch.bfloat16 if cuda and amp == torch.bfloat16 and exact is None else torch.float32
    if param_dtype != "bfloat16":
        return torch.float32
    if amp != torch.bfloat16:
        raise ValueError("trainer.param_dtype=bfloat16 computes in bf16 under bf16 autocast, which is off here "
                         "(trainer.dtype float32, or auto on a CPU without native bf16): set trainer.dtype=bfloat16 "
                         "or trainer.param_dtype to auto or float32.")
    if exact is not None:
        raise ValueError("engine.exact runs the engine's forward on the trainer's fp32 weights: set "
                         "trainer.param_dtype to auto or float32 with engine.exact.")
    return torch.bfloat16


def master_weights(models: list[Any], param_dtype: str, amp: torch.dtype | None, exact: torch.dtype | None = None,
                   frozen: list[Any] | None = None) -> MasterWeights | None:
    """`MasterWeights` over the trainable `models` where `param_dtype` resolves to bf16 (the `frozen` ones,
    e.g. a reference copy, are cast too: they need no masters); None where the models stay fp32."""
    device = next((p.device for model in models for p in model.parameters()), None)
    dtype = resolve_param_dtype(param_dtype, amp, exact, device)
    if dtype == torch.float32:
        return None
    for model in frozen or []:
        cast_weights(model, dtype)
    return MasterWeights(models, dtype)


def cast_weights(model: Any, dtype: torch.dtype) -> None:
    """Every floating-point parameter of `model` to `dtype`, in place (ties kept; buffers untouched)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


class MasterWeights:
    """fp32 masters of the trainable parameters of `models`, whose weights become `dtype`. The optimizer steps
    `masters` and is `attach`ed (`turnrl.train.optim.build_optimizer(masters, ..., master=self)` does both):
    each step then copies the masters into the weights."""

    def __init__(self, models: list[Any], dtype: torch.dtype = torch.bfloat16):
        seen: set[int] = set()
        self.weights: list[torch.nn.Parameter] = []
        for model in models:
            for p in model.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self.weights.append(p)
        if not self.weights:
            raise ValueError("the model has no trainable parameters")
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.weights]
        for model in models:
            cast_weights(model, dtype)
        self._held: list[tuple[torch.nn.Parameter, torch.Tensor]] = []   # (master, bf16 grad) of this backward
        self._task = -1                                                   # the autograd graph task they are of
        self._hooks = [w.register_post_accumulate_grad_hook(self._accumulate_into(m))
                       for w, m in zip(self.weights, self.masters)]

    def _accumulate_into(self, master: torch.nn.Parameter):
        def hook(weight: torch.Tensor) -> None:
            grad = weight.grad
            weight.grad = None
            if master.grad is not None:
                master.grad.add_(grad)
                return
            task = torch._C._current_graph_task_id()
            if task != self._task:   # the first held gradient of this backward: cast them all when it ends
                # (any still held come from a backward that raised before its end: dropped with it)
                self._held, self._task = [], task
                torch.autograd.Variable._execution_engine.queue_callback(self._cast_held)
            self._held.append((master, grad))
        return hook

    def _cast_held(self) -> None:
        """At the end of a backward: the held bf16 gradients become their masters' fp32 gradients."""
        held, self._held, self._task = self._held, [], -1   # queued with its first entry: never empty
        grads = [torch.empty_like(master) for master, _ in held]
        torch._foreach_copy_(grads, [grad for _, grad in held])
        for (master, _), grad in zip(held, grads):
            master.grad = grad

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """After each `optimizer.step()` (over `masters`), the weights take the new masters (a
        `turnrl.train.master_adamw.MasterAdamW` writes them in its step)."""
        ids = {id(m) for m in self.masters}
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if stepped != ids:
            raise ValueError("the optimizer must step exactly the master weights (build it over `masters`)")
        if hasattr(optimizer, "write_weights_of"):   # turnrl.train.master_adamw: its step writes the weights
            optimizer.write_weights_of(self.masters, self.weights, self.push)
        else:
            optimizer.register_step_post_hook(lambda *_: self.push())

    @torch.no_grad()
    def push(self) -> None:
        torch._foreach_copy_([w.data for w in self.weights], [m.data for m in self.masters])

    def state_dict(self) -> dict[str, Any]:
        return {"masters": [m.detach().cpu() for m in self.masters]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        loaded = state["masters"]
        if len(loaded) != len(self.masters) or any(a.shape != b.shape for a, b in zip(loaded, self.masters)):
            raise ValueError(f"the checkpoint's {len(loaded)} master weights do not fit the model's "
                             f"{len(self.masters)} trainable parameters")
        for master, value in zip(self.masters, loaded):
            master.copy_(value)
        self.push()

    def resume(self, state: dict[str, Any] | None) -> None:
        """After a checkpoint's weights were loaded: its masters, or, from a checkpoint of an fp32 run (no
        masters saved), the loaded weights as they now stand in bf16 (rounded once, with a warning)."""
        if state is not None:
            self.load_state_dict(state)
            return
        warnings.warn("the checkpoint holds no fp32 master weights (an fp32 run's): the masters start from its "
                      "weights rounded to bf16; resume with trainer.param_dtype=float32 to keep every bit",
                      stacklevel=2)
        with torch.no_grad():
            torch._foreach_copy_([m.data for m in self.masters], [w.data for w in self.weights])
