"""Batch-invariant building blocks: each token's result is the same bits whatever else is in the call.

See turnrl/exact/__init__.py for the reasoning. Forward values are exact; the autograd functions give the
ordinary gradient of the same mathematical function (recomputed with plain kernels), which needs no bitwise
agreement with anything.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from turnrl.exact import triton_build, triton_ops, triton_tree

KEY_BLOCK = 64   # attention reads keys in blocks of this many, at absolute positions [j * 64, (j + 1) * 64)
QUERY_TILE = 16  # attention GEMMs take this many query rows (query heads x positions) at a time


def tile_rows(device: torch.device) -> int:
    """Rows per GEMM tile: small on CPUs (decode batches are small there), larger on GPUs."""
    return 16 if device.type == "cpu" else 128


# -- sums and norms ---------------------------------------------------------------------------------------
def tree_levels(x: torch.Tensor) -> list[torch.Tensor]:
    """The levels of a pairwise sum tree over the last axis, zero-padded to a power of two P: level 0 is the
    padded input, level j has P / 2**j entries and entry i of level j sums entries i and i + P / 2**j of level
    j - 1. Elementwise adds only, so the order depends on nothing but the axis length, and trailing zeros
    leave every sum's bits unchanged (the tree over 2n values is the tree over the first n plus zeros)."""
    n = x.shape[-1]
    width = triton_build.pow2(n)
    if width != n:
        x = F.pad(x, (0, width - n))
    levels = [x]
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
        levels.append(x)
    return levels


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` in the fixed pairwise-tree order of `tree_levels` (on CUDA one Triton kernel with the
    same adds in the same order: `triton_tree`)."""
    x = x.movedim(dim, -1)
    if triton_tree.usable(x):
        return triton_tree.tree_sum_last(x)
    return tree_levels(x)[-1][..., 0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with float32 statistics (tree-summed; on CUDA one kernel per row, `triton_ops.rms_norm`), the
    scale applied in the input dtype."""
    if triton_ops.rms_usable(x, weight):
        return triton_ops.rms_norm(x, weight, eps)
    h = x.float()
    mean_square = tree_sum(h * h) / h.shape[-1]
    h = h * torch.rsqrt(mean_square + eps).unsqueeze(-1)
    return weight * h.to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up from plain elementwise ops (CPU kernels may take another exp in a vector loop's tail);
    on CUDA one kernel (`triton_ops.silu_mul`)."""
    if triton_ops.elementwise_usable(gate):
        return triton_ops.with_plain_gradient(triton_ops.silu_mul, plain_silu_mul, gate, up)
    return plain_silu_mul(gate, up)


def plain_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.float()
    return (g / (1.0 + torch.exp(-g)) * up.float()).to(gate.dtype)


def rope_tables(inv_freq: torch.Tensor, scaling: float, length: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [length, head_dim] in `dtype`, from float64 angles: the same table rows whatever the length."""
    freqs = torch.arange(length, device=inv_freq.device, dtype=torch.float64)[:, None] * inv_freq.double()[None]
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., heads, D] (cos/sin [..., 1, D]); on CUDA one kernel (`triton_ops.rope`)."""
    if triton_ops.elementwise_usable(x) and cos.dtype == x.dtype:
        return triton_ops.with_plain_gradient(triton_ops.rope, plain_rope, x, cos, sin)
    return plain_rope(x, cos, sin)


def plain_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


# -- matmuls ------------------------------------------------------------------------------------------------
def _tiled(x: torch.Tensor, weight: torch.Tensor, tile: int) -> torch.Tensor:
    """x [N, K] @ weight.T, one fixed-shape [tile, K] GEMM per tile of rows (the tail zero-padded); on CUDA in
    bf16/fp16 one Triton GEMM of fixed blocking instead (`triton_ops.matmul`)."""
    if triton_ops.matmul_usable(x, weight):
        return triton_ops.matmul(x, weight)
    n = x.shape[0]
    pad = (-n) % tile
    if pad or not x.is_contiguous():
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x.contiguous()
    out = torch.empty((n + pad, weight.shape[0]), dtype=x.dtype, device=x.device)
    wt = weight.t()
    for s in range(0, n + pad, tile):
        torch.mm(x[s:s + tile], wt, out=out[s:s + tile])
    return out[:n]


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, tile: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return _tiled(x, weight, tile)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        gx = grad @ weight if ctx.needs_input_grad[0] else None
        gw = grad.t() @ x if ctx.needs_input_grad[1] else None
        return gx, gw, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with a batch-invariant forward: x [..., K], weight [N, K] (same dtype) -> [..., N]."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    tile = tile_rows(x.device)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        out = _Linear.apply(flat, weight, tile)
    else:
        out = _tiled(flat, weight, tile)
    out = out.reshape(*lead, weight.shape[0])
    return out if bias is None else out + bias


# -- attention ----------------------------------------------------------------------------------------------
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, scale: float) -> torch.Tensor:
    if triton_ops.attention_usable(q):   # on CUDA one kernel, the same scheme as an online softmax
        return triton_ops.attention(q, k, v, qpos, scale, KEY_BLOCK, QUERY_TILE)
    r, kv, m, d = q.shape
    length = k.shape[2]
    blocks = length // KEY_BLOCK
    pad = (-m) % QUERY_TILE
    # the tile GEMMs run in the model dtype: bf16 tile GEMMs were batch-invariant on the H200 and float32 ones
    # were not (benchmarks/exact_probe.py); the scores are then bf16 as in transformers' eager attention
    qf = q
    if pad:   # padding queries see key 0 only, so every row stays finite; their output is dropped
        qf = F.pad(qf, (0, 0, 0, pad))
        qpos = F.pad(qpos, (0, pad))
    tiles = (m + pad) // QUERY_TILE
    qt = qf.reshape(r, kv, tiles, 1, QUERY_TILE, d)
    kb = k.reshape(r, kv, 1, blocks, KEY_BLOCK, d)
    vb = v.reshape(r, kv, 1, blocks, KEY_BLOCK, d)
    scores = torch.matmul(qt, kb.transpose(-1, -2)).float() * scale              # [r, kv, tiles, blocks, Qt, S]
    kpos = torch.arange(length, device=q.device).view(blocks, KEY_BLOCK)
    visible = kpos[None, None, :, None, :] <= qpos.reshape(r, tiles, 1, QUERY_TILE, 1)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    top = scores.amax(dim=(-3, -1), keepdim=True)                                # exact in any order
    p = torch.exp(scores - top)
    total = tree_sum(tree_sum(p, -1), -2)                                        # [r, kv, tiles, Qt]
    acc = tree_sum(torch.matmul(p.to(v.dtype), vb).float(), -3)                  # [r, kv, tiles, Qt, d]
    out = acc / total.unsqueeze(-1)
    return out.reshape(r, kv, tiles * QUERY_TILE, d)[:, :, :m].to(q.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor,
                scale: float) -> torch.Tensor:
        ctx.save_for_backward(q, k, v, qpos)
        ctx.scale = scale
        return _attention(q, k, v, qpos, scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        q, k, v, qpos = ctx.saved_tensors
        with torch.enable_grad():
            qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
            scores = torch.matmul(qf, kf.transpose(-1, -2)) * ctx.scale             # [r, kv, m, L]
            kpos = torch.arange(k.shape[2], device=q.device)
            scores = scores.masked_fill(~(kpos[None, None, None, :] <= qpos[:, None, :, None]), float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1), vf)
            gq, gk, gv = torch.autograd.grad(out, (qf, kf, vf), grad.float())
        return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype), None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention by absolute position, the same bits for a query in any call.

    q [R, KV, M, D]: each row's queries, grouped under their key/value head (M = positions x group heads);
    k, v [R, KV, L, D]: the row's keys at positions [0, L), L a multiple of KEY_BLOCK (zero-padded);
    qpos [R, M]: each query's position; it sees keys at positions <= its own. -> [R, KV, M, D]."""
    if k.shape[2] % KEY_BLOCK:
        raise ValueError(f"exact attention needs a key length that is a multiple of {KEY_BLOCK}, got {k.shape[2]}")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, qpos, scale)
    return _attention(q, k, v, qpos, scale)


def pad_keys(x: torch.Tensor, dim: int = 2) -> torch.Tensor:
    """Zero-pad the key axis to a multiple of KEY_BLOCK."""
    missing = (-x.shape[dim]) % KEY_BLOCK
    if not missing:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


# -- the head -------------------------------------------------------------------------------------------------
class SoftmaxTree(NamedTuple):
    """exp(logits / t - max) and the fixed pairwise tree over it, as the log-sum-exp and the sampler read it.

    `levels` are `tree_levels` levels `below`, `below` + 1, ..., the root: all of them (`below` = 0, levels[0]
    the zero-padded leaves) on CPUs; on CUDA the kernel `triton_tree.vocab_tree` writes level `below` and
    `leaves` holds the leaves unpadded, from which a group's bottom levels are rebuilt in the same order."""
    logits: torch.Tensor        # [N, V] float32
    temperature: torch.Tensor   # [N, 1] float32
    top: torch.Tensor           # [N]: max of logits / t
    leaves: torch.Tensor        # [N, V]
    levels: list[torch.Tensor]
    below: int

    @property
    def total(self) -> torch.Tensor:
        return self.levels[-1][..., 0]

    def scaled(self) -> torch.Tensor:
        return self.logits / self.temperature


def softmax_tree(logits: torch.Tensor, temperature: torch.Tensor) -> SoftmaxTree:
    """logits [N, V] float32, temperature [N, 1] float32 (1 for greedy rows)."""
    # division by t > 0 is monotone, so max(l / t) = max(l) / t exactly, without an [N, V] temporary
    top = logits.amax(dim=-1, keepdim=True) / temperature
    if triton_tree.vocab_usable(logits):
        leaves, level = triton_tree.vocab_tree(logits, temperature.squeeze(-1), top.squeeze(-1))
        _, below = triton_tree.vocab_split(logits.shape[-1])
        return SoftmaxTree(logits, temperature, top.squeeze(-1), leaves, tree_levels(level), below)
    levels = tree_levels(torch.exp(logits / temperature - top))
    return SoftmaxTree(logits, temperature, top.squeeze(-1), levels[0][..., :logits.shape[-1]], levels, 0)


def _descend(levels: list[torch.Tensor], target: torch.Tensor, index: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    for j in range(len(levels) - 1, 0, -1):
        left = levels[j - 1].gather(1, index[:, None]).squeeze(1)
        right = target >= left
        target = torch.where(right, target - left, target)
        index = torch.where(right, index + levels[j].shape[-1], index)
    return target, index


def tree_search(tree: SoftmaxTree, target: torch.Tensor) -> torch.Tensor:
    """The leaf [N] where the tree's cumulative weight passes `target` [N] (0 <= target < total): from the
    root down, right where the target reaches past the left child's sum. No scan, whose order would depend on
    the batch. It may land on a zero leaf (padding) when rounding walks past the last positive weight."""
    target, index = _descend(tree.levels, target, torch.zeros_like(target, dtype=torch.long))
    if tree.below:   # rebuild the bottom levels of the group index, index + W, ... from its stored leaves
        width, vocab = tree.levels[0].shape[-1], tree.leaves.shape[-1]
        members = index[:, None] + torch.arange(1 << tree.below, device=index.device) * width
        inside = members < vocab
        group = torch.where(inside, tree.leaves.gather(1, members.clamp(max=vocab - 1)), 0.0)
        _, member = _descend(tree_levels(group), target, torch.zeros_like(index))
        index = index + member * width
    return index


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor,
                   tree: SoftmaxTree | None = None, entropy: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logprobs [N], log-sum-exp [N], entropy [N]) of `tokens` [N] under softmax(logits / temperature),
    the sums in tree order; `tree` reuses a `softmax_tree` of the same arguments."""
    tree = tree if tree is not None else softmax_tree(logits, temperature)
    z = tree.total
    lse = tree.top + torch.log(z)
    lp = logits.gather(1, tokens[:, None]).squeeze(1) / temperature.squeeze(1) - lse
    if not entropy:
        return lp, lse, None
    return lp, lse, lse - tree_sum(tree.leaves * tree.scaled()) / z


def head_logits(hidden: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                eps: float) -> torch.Tensor:
    """Final norm and LM head -> float32 logits [N, V] (hidden [N, H])."""
    return linear(rms_norm(hidden, norm, eps), weight, bias).float()


class _HeadLogprobs(torch.autograd.Function):
    """Logprobs of `labels` from final hidden states (after the norm), chunked; the backward recomputes each
    chunk's logits with a plain GEMM and forms d logits = g * (onehot - softmax) / temperature."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=h.device)
        lse, ent = torch.empty_like(lp), torch.empty_like(lp)
        for s in range(0, n, chunk):
            logits = _tiled(h[s:s + chunk], weight, tile_rows(h.device)).float()
            temp = torch.full((logits.shape[0], 1), temperature, dtype=torch.float32, device=h.device)
            lp[s:s + chunk], lse[s:s + chunk], ent[s:s + chunk] = token_logprobs(logits, labels[s:s + chunk], temp)
        ctx.save_for_backward(h, weight, labels, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, grad_lp: torch.Tensor, _grad_ent: torch.Tensor) -> tuple:
        h, weight, labels, lse = ctx.saved_tensors
        gh = torch.empty_like(h)
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, h.shape[0], ctx.chunk):
            hs = h[s:s + ctx.chunk]
            logits = (hs @ weight.t()).float() / ctx.temperature
            onehot = torch.zeros_like(logits).scatter_(1, labels[s:s + ctx.chunk, None], 1.0)
            d = ((onehot - torch.exp(logits - lse[s:s + ctx.chunk, None]))
                 * (grad_lp[s:s + ctx.chunk].float() / ctx.temperature)[:, None]).to(h.dtype)
            gh[s:s + ctx.chunk] = d @ weight
            gw += (d.t() @ hs).float()
        return gh, gw.to(weight.dtype), None, None, None


def head_logprobs(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                  chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [N], entropy [N]) of labels [N] from normed hidden states h [N, H]; differentiable in h, weight."""
    chunk = max(tile_rows(h.device), chunk // tile_rows(h.device) * tile_rows(h.device))
    return _HeadLogprobs.apply(h, weight, labels, float(temperature), chunk)
