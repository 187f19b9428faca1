"""Batched sampling on the device with per-request randomness that ignores the rest of the batch.

Each row draws one uniform number u from a counter-based hash of (request key, token index), computed in
integer arithmetic on the device, and takes the token whose cumulative probability first passes u (inverse
CDF). No generator state is shared between rows or kept between steps, so a request samples the same tokens
whatever else is in the batch and whichever batch slot it has (up to float noise in the logits), and the whole
step stays a fixed sequence of kernels that a CUDA graph can replay.

The hash is a few rounds of xorshift-multiply on 32-bit values held in int64 (multipliers below 2**31, so no
product overflows); it is not cryptographic, only well mixed. Logprobs are log softmax(logits / temperature)
of the sampled token, before top-k/top-p truncation; temperature 0 is greedy with temperature-1 logprobs.
"""

from __future__ import annotations

import torch

from turnrl.exact import ops as exact_ops

_MASK32 = 0xFFFFFFFF
_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D)   # odd, < 2**31
_SALTS = (0x1B56C4E9, 0x68E31DA4)          # keep seed and counter hashes apart (mix(0) is 0)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2**32) (int64 tensors)."""
    x = x ^ (x >> 16)
    x = (x * _MULTIPLIERS[0]) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MULTIPLIERS[1]) & _MASK32
    return x ^ (x >> 16)


def _mix_int(x: int) -> int:
    x ^= x >> 16
    x = (x * _MULTIPLIERS[0]) & _MASK32
    x ^= x >> 15
    x = (x * _MULTIPLIERS[1]) & _MASK32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A request's 32-bit key from any Python int seed."""
    seed %= 1 << 64
    return _mix_int(_mix_int((seed >> 32) ^ _SALTS[0]) ^ (seed & _MASK32))


def uniform(key: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """One float32 in [0, 1) per row from (key [B], counter [B]) int64 -> [B]."""
    h = _mix(key ^ _mix((counter & _MASK32) ^ _SALTS[1]))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def sample(logits: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor, counter: torch.Tensor,
           top_k: torch.Tensor, top_p: torch.Tensor, truncate: bool, greedy_rows: bool = True
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. logits [B, V] float32; temperature/top_p [B] float32; key/counter/top_k [B]
    int64 -> (tokens [B] int64, logprobs [B] float32).

    `truncate` and `greedy_rows` are static choices (one compiled/captured variant each), so the common step
    has no sort and no greedy pass: `truncate=False` skips top-k/top-p (rows with top_k 0 and top_p 1 are
    unchanged by truncation anyway), `greedy_rows=False` promises no row has temperature 0. A greedy row takes
    the first maximal logit through the same search as sampling (weight 1 on the maxima, 0 elsewhere, u = 0),
    so there is no argmax reduction (which torch.compile's split reductions over a 150k vocabulary broke)."""
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    top = scaled.amax(dim=-1, keepdim=True)
    weights = (scaled - top).exp_()                               # unnormalized probabilities, max 1
    total = weights.sum(dim=-1, keepdim=True)
    if truncate:
        weights = _truncate(weights, total, top_k, top_p)
    u = uniform(key, counter)
    if greedy_rows:
        weights = torch.where(greedy.unsqueeze(1), (scaled == top).to(weights.dtype), weights)
        u = torch.where(greedy, torch.zeros_like(u), u)
    cdf = weights.cumsum(dim=-1)
    # the first token whose cdf passes u: a zero-weight token is never picked (u may be 0)
    tokens = (cdf <= u.unsqueeze(1) * cdf[:, -1:]).sum(dim=-1).clamp(max=logits.shape[1] - 1)
    logprobs = scaled.gather(1, tokens.unsqueeze(1)).squeeze(1) - (top.squeeze(1) + total.squeeze(1).log())
    return tokens, logprobs


def _truncate(weights: torch.Tensor, total: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the weights outside each row's top-k and top-p nucleus, in place of order (keeps the top token)."""
    vocab = weights.shape[1]
    ordered, order = weights.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=weights.device).unsqueeze(0)
    keep = ranks < torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    before = ordered.cumsum(dim=-1) - ordered                      # mass of the tokens ranked above
    keep &= (before < top_p.unsqueeze(1) * total) | (top_p >= 1).unsqueeze(1)
    keep |= ranks == 0
    return torch.zeros_like(weights).scatter(1, order, ordered * keep)


def sample_exact(logits: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor, counter: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` for engine.exact (no top-k/top-p): every reduction is batch-invariant (turnrl.exact).

    The token is found by descending the fixed pairwise tree of exp(scaled - max) that the log-sum-exp uses
    (`turnrl.exact.ops.tree_levels`), from the root towards the leaf whose cumulative weight passes u * total:
    inverse-CDF sampling with no scan, whose order would depend on the batch. Greedy rows take the first
    maximal logit. The logprob is `turnrl.exact.ops.token_logprobs`, the trainer's computation."""
    greedy = temperature == 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    tree = exact_ops.softmax_tree(logits, temp)
    index = exact_ops.tree_search(tree, uniform(key, counter) * tree.total)
    best = logits.argmax(dim=-1)   # greedy rows have t = 1: the first maximal logit
    # rounding can walk past the last positive weight (u * total rounding up to total): take the mode then
    vocab = logits.shape[-1]
    landed = tree.leaves.gather(1, index.clamp(max=vocab - 1)[:, None]).squeeze(1)
    index = torch.where((index < vocab) & (landed > 0), index, best)
    tokens = torch.where(greedy, best, index)
    logprobs, _, _ = exact_ops.token_logprobs(logits, tokens, temp, tree, entropy=False)
    return tokens, logprobs
