"""Sampled-token logprobs straight from hidden states, chunk by chunk, without materialising the logits.

For a vocabulary of V and N tokens the full logits are an [N, V] tensor (Qwen2.5: V = 151,936, so 16k tokens
give 5 GB in bf16, 10 GB once upcast), written, upcast, reduced and kept for the backward pass. Here the
lm_head matmul runs on chunks of tokens: the forward keeps only each token's log-sum-exp, the backward
recomputes a chunk's logits and forms d logits = g * (onehot - softmax) / temperature directly. The price is
one extra lm_head matmul in the backward (recompute); the gain is memory that no longer grows with V * N and
far less memory traffic. The same idea as fused linear cross-entropy kernels, but the gradient is for an
arbitrary upstream gradient on each token's logprob (PPO needs that), so nothing is precomputed forward.
On a CPU, where memory is plentiful and the matmul is the cost, the forward keeps the (unnormalised) softmax
when it fits `KEEP_SOFTMAX_BYTES` and the backward skips the recompute; a frozen head (LoRA) gets no weight
gradient at all.

Only the rows the caller selects are computed at all: an RL update needs logprobs of policy tokens only,
not of the prompt, tool results or user turns. On GPUs the per-chunk work after the matmul (upcast,
log-sum-exp, gather, entropy; the backward's softmax-gradient) runs as the Triton kernels of `head_kernel`, one
pass over the logits each, or, without Triton, as chunk bodies compiled by torch.compile.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from turnrl.train import head_kernel


def _chunk_forward(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, inv_temp: float, keep: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(logprobs, log-sum-exp, entropy, the unnormalised softmax and its row sums if `keep`) of one chunk.
    One [N, V] buffer besides the logits, written in place: a max, an exp, a sum and a row-wise dot are the
    only passes over it."""
    logits = (h @ w.T).float()
    if inv_temp != 1.0:
        logits.mul_(inv_temp)
    top = logits.amax(-1, keepdim=True)
    p = torch.sub(logits, top).exp_()
    total = p.sum(-1)
    lse = top.squeeze(1) + total.log()
    lp = logits.gather(1, labels[:, None]).squeeze(1) - lse
    ent = lse - (p[:, None, :] @ logits[:, :, None]).view(-1) / total
    return lp, lse, ent, (p, total) if keep else None


def _chunk_backward(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                    inv_temp: float, kept: tuple[torch.Tensor, torch.Tensor] | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d hidden, d logits) of one chunk: d logits = g * (onehot - softmax) / temperature, from the softmax the
    forward kept or recomputed in place from the logits (`add_weight_grad` turns d logits into d weight)."""
    scale = g * inv_temp
    if kept is None:
        logits = (h @ w.T).float()
        if inv_temp != 1.0:
            logits.mul_(inv_temp)
        dlogits = logits.sub_(lse[:, None]).exp_().mul_(-scale[:, None])
    else:
        p, total = kept
        dlogits = p * (-scale / total)[:, None]
    dlogits[torch.arange(len(labels), device=labels.device), labels] += scale
    dlogits = dlogits.to(h.dtype)
    return dlogits @ w, dlogits


# The same two chunk steps written as pure expressions, for torch.compile on CUDA without Triton's kernels
# (and the A/B in benchmarks/fused_head_ab.sh). Inductor fuses the upcast into its reductions, but reads the
# logits three times in the forward (two log-sum-exp reductions, the entropy's sum) and runs the backward's
# pointwise kernel at about a third of the bandwidth: ~22 ms an update in an H100 profile, 6.7 ms with
# `head_kernel`. The in-place bodies above suit eager CPUs; compiled, their in-place steps and the entropy's
# batched dot product became extra passes and copies (an H200 profile: 13 ms of gemv and 11 ms of device
# copies per update).
def _fused_forward(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, inv_temp: float, keep: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    logits = (h @ w.T).float() * inv_temp
    lse = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(1, labels[:, None]).squeeze(1) - lse
    p = torch.exp(logits - lse[:, None])
    ent = lse - (p * logits).sum(-1)
    return lp, lse, ent, (p, torch.ones_like(lse)) if keep else None


def _fused_backward(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                    inv_temp: float, kept: tuple[torch.Tensor, torch.Tensor] | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    scale = g * inv_temp
    p = kept[0] / kept[1][:, None] if kept is not None else torch.exp((h @ w.T).float() * inv_temp - lse[:, None])
    onehot = torch.zeros_like(p).scatter_(1, labels[:, None], 1.0)
    dlogits = ((onehot - p) * scale[:, None]).to(h.dtype)
    return dlogits @ w, dlogits


# Where the softmax of the selected tokens fits this many bytes, the forward keeps it and the backward skips
# recomputing the logits: on a CPU that is one of the head's three [N, H] x [H, V] matmuls saved, for memory a
# CPU has (1 GiB: 5,000 tokens of a 49k vocabulary). GPUs recompute (their memory is the scarce part).
KEEP_SOFTMAX_BYTES: dict[str, int] = {"cpu": 1 << 30}

_KERNELS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}


# With Triton, CUDA runs the chunk's passes over the logits as the kernels of `head_kernel` (one read for the
# forward's statistics, one read and write for the gradient, in place); the matmuls stay cuBLAS's.
def _triton_forward(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, inv_temp: float, keep: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    if keep:
        raise ValueError("the Triton head kernels recompute the softmax; they do not keep it (KEEP_SOFTMAX_BYTES)")
    lp, lse, ent = head_kernel.logit_stats(h @ w.T, labels, inv_temp)
    return lp, lse, ent, None


def _triton_backward(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                     inv_temp: float, kept: None) -> tuple[torch.Tensor, torch.Tensor]:
    dlogits = head_kernel.logit_grad_(h @ w.T, labels, lse, g * inv_temp, inv_temp)
    return dlogits @ w, dlogits


def add_weight_grad(acc: torch.Tensor | None, dlogits: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """acc + dlogits^T h in float32 (the product alone where acc is None): the head's weight gradient summed
    over chunks. On CUDA with 16-bit operands cuBLAS writes the product in float32 with acc added in its
    epilogue: no 16-bit product rounded, stored and upcast in another pass (an H100 profile: ~0.8 ms a chunk
    for those passes on Qwen2.5's 151936 x 896 head)."""
    if dlogits.is_cuda and dlogits.dtype in (torch.bfloat16, torch.float16):
        if acc is None:
            return torch.mm(dlogits.T, h, out_dtype=torch.float32)
        return torch.addmm(acc, dlogits.T, h, out_dtype=torch.float32)
    product = (dlogits.T @ h).float()
    return product if acc is None else acc.add_(product)


def _kernels(device: torch.device) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The Triton chunk kernels on CUDA, compiled chunk bodies there without Triton (fused epilogues), the
    in-place eager functions elsewhere."""
    if device.type != "cuda":
        return _chunk_forward, _chunk_backward
    if "cuda" not in _KERNELS:
        _KERNELS["cuda"] = (_triton_forward, _triton_backward) if head_kernel.available(device) else \
            (torch.compile(_fused_forward, dynamic=True), torch.compile(_fused_backward, dynamic=True))
    return _KERNELS["cuda"]


class _LinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                temperature: float, compute_dtype: torch.dtype, keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
        fwd, _ = _kernels(hidden.device)
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(lp)
        ent = torch.empty_like(lp)
        w = weight.to(compute_dtype)
        inv_temp = 1.0 / temperature
        kept = []
        for s in range(0, n, chunk):
            lp[s:s + chunk], lse[s:s + chunk], ent[s:s + chunk], p = fwd(
                hidden[s:s + chunk].to(compute_dtype), w, labels[s:s + chunk], inv_temp, keep)
            kept.append(p)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk, ctx.inv_temp, ctx.compute_dtype, ctx.kept = chunk, inv_temp, compute_dtype, kept
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, grad_lp: torch.Tensor, _grad_ent: torch.Tensor) -> tuple:
        hidden, weight, labels, lse = ctx.saved_tensors
        _, bwd = _kernels(hidden.device)
        dtype, chunk, need_w = ctx.compute_dtype, ctx.chunk, ctx.needs_input_grad[1]
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = None
        for i, s in enumerate(range(0, hidden.shape[0], chunk)):
            h = hidden[s:s + chunk].to(dtype)
            gh, dlogits = bwd(h, w, labels[s:s + chunk], lse[s:s + chunk], grad_lp[s:s + chunk].float(),
                              ctx.inv_temp, ctx.kept[i])
            grad_hidden[s:s + chunk] = gh.to(hidden.dtype)
            if need_w:
                grad_weight = add_weight_grad(grad_weight, dlogits, h)
        if need_w and grad_weight is None:   # no tokens selected
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        return (grad_hidden, grad_weight.to(weight.dtype) if need_w else None, None, None, None, None, None)


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                    chunk: int = 4096, compute_dtype: torch.dtype | None = None,
                    select: torch.Tensor | None = None, selected: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [B, T, H], weight [V, H], labels [B, T] -> (logprobs [B, T] float32, entropy [B, T]).

    Logprobs of `labels` under softmax(hidden @ weight.T / temperature), differentiable in hidden and weight;
    the entropy (a metric) carries no gradient. With `select` [B, T] (bool), only those positions are
    computed and the others are 0. `selected`, the number of True in `select` when the caller knows it (from
    the host's counts), spares the device sync that a boolean index costs (the count is checked on the device,
    asynchronously)."""
    b, t, h = hidden.shape
    dtype = compute_dtype or hidden.dtype
    where = None
    if select is None:
        flat_h, flat_labels = hidden.reshape(b * t, h), labels.reshape(b * t)
    elif selected is None:
        flat_h, flat_labels = hidden[select], labels[select]
    else:
        flat = select.reshape(-1)
        if flat.is_cuda:
            torch._assert_async(flat.sum() == selected, "linear_logprobs: `selected` is not the count of `select`")
        elif int(flat.sum()) != selected:
            raise ValueError(f"linear_logprobs: selected={selected} but select has {int(flat.sum())} positions")
        where = torch.nonzero_static(flat, size=selected).squeeze(1)
        rows, cols = where // t, where % t
        flat_h, flat_labels = hidden[rows, cols], labels[rows, cols]
    keep = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad) and \
        flat_h.shape[0] * weight.shape[0] * 4 <= KEEP_SOFTMAX_BYTES.get(hidden.device.type, 0)
    lp, ent = _LinearLogprob.apply(flat_h, weight, flat_labels, chunk, float(temperature), dtype, keep)
    if select is None:
        return lp.view(b, t), ent.view(b, t)
    if where is not None:
        return lp.new_zeros(b * t).index_copy(0, where, lp).view(b, t), \
            ent.new_zeros(b * t).index_copy(0, where, ent).view(b, t)
    out_lp = torch.zeros((b, t), dtype=lp.dtype, device=lp.device).masked_scatter(select, lp)
    out_ent = torch.zeros((b, t), dtype=ent.dtype, device=ent.device).masked_scatter(select, ent)
    return out_lp, out_ent
