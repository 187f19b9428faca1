"""The Triton kernel of `turnrl.train.master_adamw`: one AdamW step over many tensors, writing the 16-bit weights.

Imported only when the kernel is first used: importing it needs Triton. Each program takes one chunk of one
tensor; the tensors are reached through tables of their addresses (as a multi-tensor apply), so one launch
steps every parameter. The arithmetic is torch's fused AdamW's (ATen's fused_adam_utils), in float32.
"""

import triton
import triton.language as tl

from turnrl.train.swiglu_triton import _round


@triton.jit
def _at(table, i, dtype: tl.constexpr):
    """Tensor i's address from `table`, 16-byte aligned (the caller checks), so the loads can be 16 bytes wide."""
    return tl.multiple_of(tl.load(table + i).to(tl.pointer_type(dtype)), 16)


@triton.jit
def adamw(chunk_tensor, chunk_start, master_t, grad_t, avg_t, sq_t, weight_t, step_t, numel_t, scale_ptr, lr,
          beta1, beta2, eps, weight_decay, HAS_SCALE: tl.constexpr, GRAD: tl.constexpr, WEIGHT: tl.constexpr,
          CHUNK: tl.constexpr, BLOCK: tl.constexpr, WIDEN: tl.constexpr):
    """Chunk `program_id` of tensor `chunk_tensor[pid]` from `chunk_start[pid]`: master (float32), its gradient
    (GRAD, divided by *scale_ptr with HAS_SCALE), exp_avg and exp_avg_sq (float32) stepped in place at the tensor's
    step count (already incremented), and the master rounded to nearest into the weight (WEIGHT; WIDEN: the
    interpreter, whose conversion to bf16 truncates)."""
    pid = tl.program_id(0)
    i = tl.load(chunk_tensor + pid)
    start = tl.multiple_of(tl.load(chunk_start + pid), CHUNK)
    n = tl.load(numel_t + i)
    master = _at(master_t, i, tl.float32)
    grad = _at(grad_t, i, GRAD)
    avg = _at(avg_t, i, tl.float32)
    sq = _at(sq_t, i, tl.float32)
    weight = _at(weight_t, i, WEIGHT)
    step = tl.load(_at(step_t, i, tl.float32))
    correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
    step_size = lr / correction1
    scale = tl.load(scale_ptr) if HAS_SCALE else 1.0
    end = tl.minimum(start + CHUNK, n)
    full = start + (end - start) // BLOCK * BLOCK   # whole blocks without a mask (16-byte loads), then the tail
    for first in range(start, full, BLOCK):
        _update(master, grad, avg, sq, weight, first + tl.arange(0, BLOCK), end, scale, lr, beta1, beta2, eps,
                weight_decay, step_size, correction2_sqrt, HAS_SCALE, WEIGHT, False, WIDEN)
    if full < end:
        _update(master, grad, avg, sq, weight, full + tl.arange(0, BLOCK), end, scale, lr, beta1, beta2, eps,
                weight_decay, step_size, correction2_sqrt, HAS_SCALE, WEIGHT, True, WIDEN)


@triton.jit
def _update(master, grad, avg, sq, weight, idx, end, scale, lr, beta1, beta2, eps, weight_decay, step_size,
            correction2_sqrt, HAS_SCALE: tl.constexpr, WEIGHT: tl.constexpr, MASKED: tl.constexpr,
            WIDEN: tl.constexpr):
    """torch's fused AdamW on the elements `idx` (MASKED: those before `end`)."""
    if MASKED:
        live = idx < end
        p = tl.load(master + idx, mask=live, other=0.0)
        g = tl.load(grad + idx, mask=live, other=0.0).to(tl.float32)
        m = tl.load(avg + idx, mask=live, other=0.0)
        v = tl.load(sq + idx, mask=live, other=0.0)
    else:
        p = tl.load(master + idx)
        g = tl.load(grad + idx).to(tl.float32)
        m = tl.load(avg + idx)
        v = tl.load(sq + idx)
    if HAS_SCALE:
        g = g / scale
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / correction2_sqrt + eps)
    w = _round(p, WEIGHT, WIDEN)
    if MASKED:
        tl.store(master + idx, p, mask=live)
        tl.store(avg + idx, m, mask=live)
        tl.store(sq + idx, v, mask=live)
        tl.store(weight + idx, w, mask=live)
    else:
        tl.store(master + idx, p)
        tl.store(avg + idx, m)
        tl.store(sq + idx, v)
        tl.store(weight + idx, w)
