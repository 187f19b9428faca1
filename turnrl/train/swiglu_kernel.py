"""A SwiGLU MLP whose activation runs in its GEMMs' epilogues (`trainer.fused_mlp`).

A decoder layer's MLP is down(silu(gate(x)) * up(x)). Compiled as is, the activation is two memory-bound
passes over [tokens, intermediate] tensors: the forward reads g and u and writes h = silu(g) * u; the
backward reads dh (the down projection's input gradient, written by its GEMM), g and u and writes dg and du.
With Qwen2.5-0.5B's shapes and 51k tokens each such tensor is 0.5 GB, and the two passes took 31 ms of an
H100 update, at the memory's bandwidth (2026-12-07, benchmarks/results/h100_train_call_g_*).

Here two Triton GEMMs carry the activation in their epilogues (`swiglu_triton`):

- forward, `gate_up`: g = x Wg^T and u = x Wu^T in one program a tile (x's tile read once for both dots),
  h = silu(g) * u from the registers: no pass re-reads g and u;
- backward, `down_back`: dh = dy Wd in registers, then dg and du from g and u straight into one [tokens,
  2 x intermediate] buffer: dh is never written, and since dg and du sit side by side, the input gradient
  (dgu [Wg; Wu]) and the two weight gradients (dgu^T x) are one GEMM each, as `trainer.fuse_linears` wanted
  without the copy that made it slower.

The down projection (h Wd^T, and its weight gradient dy^T h) stays cuBLAS. The epilogues round where the
unfused graph rounds, so the results differ from it only by the GEMMs' order of summation. Only plain
SwiGLU MLPs take this path (bias-free nn.Linear gate/up/down, SiLU, weights and input of one 16-bit dtype,
on CUDA, widths multiples of the blocking); others (LoRA, quantized or biased layers) keep their forward.

Measured on an H200 (2026-12-07, benchmarks/results/h200_swiglu_probe_2026-12-07.json and
h200_train_call_h_*): the saved passes are real (the update's SiLU kernels, 22 ms, are gone), but the GEMMs
measured (cp.async pointer loads and `tl.dot`, no TMA or warp specialisation) run well below cuBLAS: alone,
`gate_up` takes 1.76 ms against cuBLAS's 1.24 for the two GEMMs plus 0.57 for the SiLU pass, `down_back` 1.57
against 0.63 + 0.90; in the update the two kernels take 82 ms where what they replace took ~66, and the update
is 14 ms slower (0.321 s against 0.307). So `trainer.fused_mlp` is off by default. Kernels that move their
tiles with tensor descriptors (TMA) are built beside them (a sixth blocking entry), for the probe
(`benchmarks/swiglu_probe.py`) to time against the same baseline.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

# (rows, columns, depth a step, warps, stages[, tma]) of each kernel's tile; the columns are the intermediate
# size's, the depth the hidden size's; a sixth entry 1 moves the tiles with tensor descriptors (TMA on Hopper)
# instead of pointer loads. Built offline with Triton 3.6 both pointer kernels take 128 registers or fewer with 3
# stages, so two programs fit an SM; the fastest of the H200 sweep for `gate_up`, within 3% of the fastest for
# `down_back` (the TMA kernels are built and tested, not yet timed on a GPU)
GATE_UP = (128, 64, 64, 8, 3)
DOWN_BACK = (128, 64, 64, 8, 3)
GROUP_M = 8
_INTERPRET = False   # tests: run the kernels on CPU tensors (under Triton's interpreter)


@functools.cache
def _kernels() -> dict[str, Any]:
    from turnrl.train import swiglu_triton as k
    return {"gate_up": k.gate_up, "down_back": k.down_back, "gate_up_tma": k.gate_up_tma,
            "down_back_tma": k.down_back_tma}


def _blocking(name: str, blocking: tuple[int, ...], n: int, k: int) -> tuple[int, int, int, bool, dict[str, int]]:
    """(rows, columns, depth, tma, launch options) of a kernel's blocking, checked against the widths."""
    if len(blocking) not in (5, 6):
        raise ValueError(f"swiglu_kernel.{name} = {blocking}: give (rows, columns, depth, warps, stages) and "
                         "optionally tma (1: tensor descriptors)")
    block_m, block_n, block_k, warps, stages = blocking[:5]
    if n % block_n or k % block_k:
        raise ValueError(f"swiglu_kernel.{name} = {blocking}: the widths {n} and {k} must be multiples of the "
                         "columns and the depth")
    return block_m, block_n, block_k, len(blocking) == 6 and bool(blocking[5]), \
        {"num_warps": warps, "num_stages": stages}


def _descriptors(tensors: list[torch.Tensor], blocks: list[list[int]]) -> list[Any]:
    from triton.tools.tensor_descriptor import TensorDescriptor
    return [TensorDescriptor.from_tensor(t, block) for t, block in zip(tensors, blocks)]


def _grid(m: int, n: int, block_m: int, block_n: int) -> tuple[int]:
    return (-(-m // block_m) * (n // block_n),)


def gate_up(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(g, u, h) [M, N] for x [M, K] and wg, wu [N, K]: g = x wg^T, u = x wu^T, h = silu(g) * u."""
    m, k = x.shape
    n = wg.shape[0]
    g, u, h = (x.new_empty((m, n)) for _ in range(3))
    block_m, block_n, block_k, tma, options = _blocking("GATE_UP", GATE_UP, n, k)
    if m:
        args = [x, wg, wu, g, u, h]
        if tma:
            args = _descriptors(args, [[block_m, block_k], [block_n, block_k], [block_n, block_k]] +
                                [[block_m, block_n]] * 3)
        _kernels()["gate_up_tma" if tma else "gate_up"][_grid(m, n, block_m, block_n)](
            *args, m, N=n, K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M,
            WIDEN=not x.is_cuda, **options)
    return g, u, h


def down_back(dy: torch.Tensor, wd: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """dgu [M, 2N] = (dg | du) for dy [M, K], wd [K, N] and the forward's g, u [M, N]."""
    m, k = dy.shape
    n = wd.shape[1]
    dgu = dy.new_empty((m, 2 * n))
    block_m, block_n, block_k, tma, options = _blocking("DOWN_BACK", DOWN_BACK, n, k)
    if m:
        args = [dy, wd, g, u, dgu]
        if tma:
            args = _descriptors(args, [[block_m, block_k], [block_k, block_n]] + [[block_m, block_n]] * 3)
        _kernels()["down_back_tma" if tma else "down_back"][_grid(m, n, block_m, block_n)](
            *args, m, N=n, K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M,
            WIDEN=not dy.is_cuda, **options)
    return dgu


@torch.library.custom_op("turnrl::swiglu_gate_up", mutates_args=())
def _gate_up_op(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return gate_up(x, wg, wu)


@_gate_up_op.register_fake
def _(x, wg, wu):
    shape = (x.shape[0], wg.shape[0])
    return x.new_empty(shape), x.new_empty(shape), x.new_empty(shape)


@torch.library.custom_op("turnrl::swiglu_down_back", mutates_args=())
def _down_back_op(dy: torch.Tensor, wd: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return down_back(dy, wd, g, u)


@_down_back_op.register_fake
def _(dy, wd, g, u):
    return dy.new_empty((dy.shape[0], 2 * wd.shape[1]))


class _SwiGLU(torch.autograd.Function):
    """down(silu(x wg^T) * (x wu^T)) for x [M, K]; differentiable in x and the three weights."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
        g, u, h = _gate_up_op(x, wg, wu)
        ctx.save_for_backward(x, wg, wu, wd, g, u, h)
        return h @ wd.t()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, wg, wu, wd, g, u, h = ctx.saved_tensors
        need_x, need_wg, need_wu, need_wd = ctx.needs_input_grad
        dy = dy.contiguous()
        dgu = _down_back_op(dy, wd, g, u)
        dx = dgu @ torch.cat([wg, wu]) if need_x else None
        dw = dgu.t() @ x if need_wg or need_wu else None   # frozen weights (LoRA elsewhere): no weight GEMMs
        n = wg.shape[0]
        return (dx, dw[:n] if need_wg else None, dw[n:] if need_wu else None,
                dy.t() @ h if need_wd else None)


def swiglu(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    """The fused MLP on x [..., K] (contiguous), weights as nn.Linear holds them: wg, wu [N, K], wd [K, N]."""
    shape = x.shape
    return _SwiGLU.apply(x.reshape(-1, shape[-1]), wg, wu, wd).view(*shape[:-1], wd.shape[0])


_SILU = ("SiLU", "SiLUActivation")   # torch's and transformers' (ACT2FN["silu"])
_HALF = (torch.bfloat16, torch.float16)


def plain_linear(layer: Any, bias: bool | None = False) -> bool:
    """An nn.Linear as such (not LoRA- or quantization-wrapped); `bias` None: with or without one."""
    return type(layer) is torch.nn.Linear and (bias is None or (layer.bias is not None) == bias)


def plain_swiglu(mlp: Any) -> bool:
    """Whether `mlp` is a plain SwiGLU MLP: gate_proj, up_proj, down_proj bias-free nn.Linear of matching
    widths and a SiLU activation."""
    parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(plain_linear(p) for p in parts) or type(getattr(mlp, "act_fn", None)).__name__ not in _SILU:
        return False
    gate, up, down = parts
    n, k = gate.weight.shape
    return up.weight.shape == (n, k) and down.weight.shape == (k, n)


def fusable(mlp: Any) -> bool:
    """Whether `mlp` is a plain SwiGLU MLP (`plain_swiglu`) this module can run: widths multiples of the
    blocking."""
    if not plain_swiglu(mlp):
        return False
    n, k = mlp.gate_proj.weight.shape
    return n % GATE_UP[1] == 0 and n % DOWN_BACK[1] == 0 and k % GATE_UP[2] == 0 and k % DOWN_BACK[2] == 0


def runs_fused(x: torch.Tensor, weights: Any, interpret: bool) -> bool:
    """Whether a fused module's kernels take `x`: on CUDA (or `interpret`: tests under Triton's interpreter), a
    16-bit dtype that every one of `weights` shares."""
    return (x.is_cuda or interpret) and x.dtype in _HALF and all(w.dtype == x.dtype for w in weights)


def switch_forward(module: Any, forward: Any) -> None:
    """`forward` (a function of the module) becomes `module`'s, its own kept as `_turnrl_unfused_forward` for the
    inputs the fused one does not take; once a module, however often called."""
    if not hasattr(module, "_turnrl_unfused_forward"):
        module._turnrl_unfused_forward = module.forward
        module.forward = types.MethodType(forward, module)


def _fused_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
    if runs_fused(x, weights, _INTERPRET):
        return swiglu(x.contiguous(), *weights)
    return self._turnrl_unfused_forward(x)


def use_fused_mlp(model: Any) -> int:
    """Run every plain SwiGLU MLP of `model`'s decoder layers through `swiglu` (before torch.compile). Inputs
    it cannot take (CPU tensors, mixed dtypes) still go through the MLP's own forward. Returns how many MLPs
    run fused; a model with none raises ValueError."""
    switched = 0
    for module in model.modules():
        if fusable(module):
            switch_forward(module, _fused_forward)
            switched += 1
    if not switched:
        raise ValueError("trainer.fused_mlp: the model has no plain SwiGLU MLP (bias-free gate_proj, up_proj, "
                         "down_proj linears with SiLU; LoRA-wrapped layers are not fused); set "
                         "trainer.fused_mlp=false")
    return switched

