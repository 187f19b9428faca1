"""Causal attention over packed rows, forward and backward, as Triton kernels (`trainer.packed_attention: triton`).

The packed trainer (`turnrl.train.packing`) lays a micro-batch's rows end to end and needs attention kept
causal inside each row (segment of `cu_seqlens`). torch's varlen kernel is FlashAttention 2, written for
Ampere's mma instructions; on Hopper, where Triton's dots lower to the warpgroup MMA, these kernels are the
same algorithm (Dao 2023) in Triton:

- forward: one program per (query block, query head, segment), an online softmax (base 2) over the key
  blocks before the block's diagonal without a mask, then the diagonal blocks under the causal mask; it
  writes the output and each query's log-sum-exp (base 2, float32). Query blocks run longest first, those of
  every segment before any shorter block (`SCHEDULE`), so the short programs fill the tail of the grid;
- backward: `delta = rowsum(dO * O)`; then one program per (key block, key/value head, segment) walks every
  query head of its group and every query block at or after its keys in one loop (`FLAT_KEYS`), recomputing
  P from the saved log-sum-exp, and sums dV and dK in registers; and one program per (query block, query
  head, segment) sums dQ over its key blocks. No atomics: the gradients are deterministic (FlashAttention 2's
  backward adds dQ with float32 atomics), at the price of computing QK^T and dO V^T twice. `ATOMIC_DQ = True`
  is FA2's way (the key program adds its share of dQ into a float32 buffer, no dQ kernel), for comparison.

Grouped-query attention is native (a query head h reads key/value head h // group). Inputs [N, H, D]
(contiguous), D a power of two between 16 and 256, cu_seqlens int32 [S + 1]. The blocking is read from this
module at call time (`benchmarks/attention_backends_probe.py --triton-blocking` sweeps it). On CPUs the
kernels run only under Triton's interpreter (tests), with their dots widened to float32.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from turnrl.exact.triton_build import usable_on

LOG2E = 1.4426950408889634

# (program's block, step's block, warps, stages[, register cap]) of each kernel; the first a multiple of the
# second. The fastest of the sweep on an H100 at head size 64 (2026-12-07,
# benchmarks/results/h100_attention_probe_2026-12-07.json: forward 0.42 ms against 0.55 at 128x64/8 warps; dK/dV
# at 64x16/4 warps 1.99 ms forward and backward against FA2's 2.23); none spills when built offline with Triton
# 3.6, the GPU machine's (benchmarks/flash_kernel_build_probe.py; the key program at 64 x 64 spills under 3.6, with
# 8 warps or 4)
FORWARD = (64, 64, 4, 3)      # queries x keys a step
KEYS = (64, 16, 4, 3)         # backward dK/dV: keys a program x queries a step
QUERIES = (64, 32, 4, 3)      # backward dQ: queries a program x keys a step
ATOMIC_DQ = False             # True: the dK/dV kernel adds dQ with float32 atomics, no dQ kernel (FA2's way)
# The dK/dV program's walk: True, one loop over (query head of its group, query step) with the causal mask on every
# step; False, per head, the diagonal steps and then the others, two loops each pipelined on its own (14 fills and
# drains a program for Qwen2.5-0.5B's group of 7). The same sums in the same order: the same bits. Built offline
# with Triton 3.6 at 64x16/4 warps/3 stages the flat walk takes 122 registers a thread against 196, so 4 programs
# fit an SM against 2 (benchmarks/flash_kernel_build_probe.py); on an H100 the bench's update spends 16.1-16.3 ms
# in it against 20.8 (2026-12-07, benchmarks/results/h100_train_call_{e,f,g}_*).
FLAT_KEYS = True
# The grid's order (CUDA starts programs in grid order): "across" runs the longest programs of every segment
# first (the first key blocks, the last query blocks), "per_segment" runs segment after segment, longest
# first within each. A list-scheduling model of the bench's rows (64 rows of 512-1024 tokens, 2-3 programs an
# SM) puts the dK/dV kernel's tail at 17-30% of its time per segment and 3-6% across; measured on an H100
# (2026-12-07) the update's dK/dV time did not change (20.76 ms against 20.99).
SCHEDULE = "across"
_GRID_LIMIT = 65535           # CUDA's grid y and z


@functools.cache
def _kernels() -> tuple[Any, Any, Any, Any]:
    from turnrl.train import flash_triton as k
    return k.forward, k.delta, k.keys, k.queries


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> None:
    """ValueError unless q [N, H, D], k and v [N, KV, D] (contiguous, one dtype, H a multiple of KV, D a power
    of two in [16, 256]) and cu int32 [S + 1]."""
    n, heads, dim = q.shape
    if k.shape != v.shape or k.shape[0] != n or k.shape[2] != dim or heads % k.shape[1]:
        raise ValueError(f"packed attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
                         "[N, H, D], [N, KV, D], [N, KV, D] with H a multiple of KV")
    if dim < 16 or dim > 256 or dim & (dim - 1):
        raise ValueError(f"packed attention (triton): head size {dim} is not a power of two in [16, 256]; set "
                         "trainer.packed_attention: flash")
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()) or not q.dtype == k.dtype == v.dtype:
        raise ValueError("packed attention (triton): q, k, v must be contiguous and of one dtype")
    if cu.dtype != torch.int32 or cu.dim() != 1:
        raise ValueError("packed attention (triton): cu_seqlens must be a 1-d int32 tensor")


def blocking() -> dict[str, Any]:
    """The blocking the kernels run with now (for reports)."""
    return {"FORWARD": FORWARD, "KEYS": KEYS, "QUERIES": QUERIES, "ATOMIC_DQ": ATOMIC_DQ, "SCHEDULE": SCHEDULE,
            "FLAT_KEYS": FLAT_KEYS}


def _grid(blocks: int, heads: int, segments: int) -> tuple[tuple[int, int, int], bool]:
    """(grid, across) for programs over (block, head, segment) in `SCHEDULE`'s order."""
    if SCHEDULE not in ("across", "per_segment"):
        raise ValueError(f"flash_kernel.SCHEDULE = {SCHEDULE!r}: use 'across' or 'per_segment'")
    across = SCHEDULE == "across"
    z = blocks if across else segments
    if z > _GRID_LIMIT:
        fix = ("a row this long needs trainer.packed_attention: flash" if across else
               "use smaller micro-batches (trainer.micro_batch_tokens)")
        what = f"the longest row's {blocks} blocks" if across else f"{segments} rows in one micro-batch"
        raise ValueError(f"packed attention (triton): {what} exceed CUDA's grid limit of {_GRID_LIMIT}; {fix}")
    return ((segments, heads, blocks) if across else (blocks, heads, segments)), across


def _blocks(length: int, block: int) -> int:
    return max(1, -(-length // block))


def _blocking(name: str, blocking: tuple[int, ...]) -> tuple[int, int, dict[str, int]]:
    """(program's block, step's block, launch options) of a kernel's blocking, checked: the diagonal walk needs
    the program's block a multiple of the step's. A fifth entry caps the registers a thread (`maxnreg`: more
    programs an SM, at the price of spills)."""
    if len(blocking) not in (4, 5):
        raise ValueError(f"flash_kernel.{name} = {blocking}: give (program block, step block, warps, stages) "
                         "and optionally a register cap")
    outer, inner, warps, stages = blocking[:4]
    if outer % inner or outer & (outer - 1) or inner & (inner - 1) or inner < 16:
        raise ValueError(f"flash_kernel.{name} = {blocking}: its first block must be a power-of-two multiple of "
                         "its second (a power of two >= 16)")
    options = {"num_warps": warps, "num_stages": stages}
    if len(blocking) == 5 and blocking[4]:
        options["maxnreg"] = blocking[4]
    return outer, inner, options


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_length: int,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [N, H, D], lse [H, N] float32, base 2) for causal attention inside each segment of cu."""
    check_inputs(q, k, v, cu)
    n, heads, dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((heads, n), dtype=torch.float32, device=q.device)
    segments = cu.shape[0] - 1
    block_m, block_n, options = _blocking("FORWARD", FORWARD)
    if n and segments:
        n_blocks = _blocks(max_length, block_m)
        grid, across = _grid(n_blocks, heads, segments)
        _kernels()[0][grid](
            q, k, v, out, lse, cu, n, n_blocks, scale * LOG2E, H=heads, KV=k.shape[1], D=dim, BLOCK_M=block_m,
            BLOCK_N=block_n, WIDEN=not q.is_cuda, ACROSS=across, **options)
    return out, lse


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, cu: torch.Tensor, max_length: int,
             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `forward`'s output for the gradient do."""
    n, heads, dim = q.shape
    kv = k.shape[1]
    do = do.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    segments = cu.shape[0] - 1
    if not (n and segments):
        return dq.zero_(), dk.zero_(), dv.zero_()
    _, delta_k, keys_k, queries_k = _kernels()
    dl = torch.empty((heads, n), dtype=torch.float32, device=q.device)
    rows = 64
    delta_k[(-(-n * heads // rows),)](out, do, dl, n, H=heads, D=dim, BLOCK=rows, num_warps=4)
    widen, atomic = not q.is_cuda, ATOMIC_DQ
    dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic else dq
    block_n, block_m, options = _blocking("KEYS", KEYS)
    grid, across = _grid(_blocks(max_length, block_n), kv, segments)
    keys_k[grid](
        q, k, v, do, lse, dl, dk, dv, dq32, cu, n, scale, scale * LOG2E, H=heads, KV=kv, D=dim, BLOCK_N=block_n,
        BLOCK_M=block_m, WIDEN=widen, ATOMIC_DQ=atomic, ACROSS=across, FLAT=FLAT_KEYS, **options)
    if atomic:
        return dq.copy_(dq32), dk, dv
    block_m, block_n, options = _blocking("QUERIES", QUERIES)
    n_blocks = _blocks(max_length, block_m)
    grid, across = _grid(n_blocks, heads, segments)
    queries_k[grid](
        q, k, v, do, lse, dl, dq, cu, n, n_blocks, scale, scale * LOG2E, H=heads, KV=kv, D=dim, BLOCK_M=block_m,
        BLOCK_N=block_n, WIDEN=widen, ACROSS=across, **options)
    return dq, dk, dv


@torch.library.custom_op("turnrl::packed_attention_forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_length: int,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(q, k, v, cu, max_length, scale)


@_forward_op.register_fake
def _(q, k, v, cu, max_length, scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("turnrl::packed_attention_backward", mutates_args=())
def _backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, cu: torch.Tensor, max_length: int,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(do, q, k, v, out, lse, cu, max_length, scale)


@_backward_op.register_fake
def _(do, q, k, v, out, lse, cu, max_length, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, cu, max_length, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu)
    ctx.max_length, ctx.scale = max_length, scale


def _grad(ctx: Any, do: torch.Tensor, _lse_grad: torch.Tensor | None) -> tuple:
    q, k, v, out, lse, cu = ctx.saved_tensors
    dq, dk, dv = _backward_op(do, q, k, v, out, lse, cu, ctx.max_length, ctx.scale)
    return dq, dk, dv, None, None, None


_forward_op.register_autograd(_grad, setup_context=_setup)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_length: int,
                     scale: float) -> torch.Tensor:
    """Causal attention of q [N, H, D] over k, v [N, KV, D] inside each segment of cu (int32 [S + 1]), max_length
    the longest segment: [N, H, D], differentiable in q, k, v."""
    return _forward_op(q, k, v, cu, max_length, scale)[0]


def available(device: torch.device) -> bool:
    return usable_on(device, _kernels)
