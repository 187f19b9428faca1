"""Reductions over the policy tokens of a batch: sum, mean, variance and whitening under a mask.

A mask has the shape of the values it selects and is read as binary: a position counts when its mask is
nonzero (1.0 / True), whatever number is stored there. Positions with mask 0 never influence a result, not
even through NaN or inf values sitting under them: they are replaced by 0 with `torch.where` before any
arithmetic (multiplying by the mask would turn `nan * 0` into NaN and leak it).

Empty selections are not errors: a mean, variance or whitening over zero counted positions returns 0
instead of NaN, because an all-masked micro-batch (every trajectory of a row failed, say) is ordinary data
in multi-turn RL and must not poison a step.

`masked_whiten` follows the usual RL normalisation (e.g. verl's `masked_whiten`, OpenRLHF's advantage
normalisation): subtract the masked mean, divide by sqrt(unbiased masked variance + eps). Deviation: the
output is 0 on unmasked positions, so whitened advantages can be used without re-masking.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["as_bool_mask", "masked_mean", "masked_sum", "masked_var", "masked_whiten", "zero_unmasked"]


def as_bool_mask(mask: Tensor, like: Tensor, name: str = "the values") -> Tensor:
    """`mask` as a bool tensor (nonzero = counted), after checking it has the shape of `like`."""
    if mask.shape != like.shape:
        raise ValueError(
            f"mask has shape {tuple(mask.shape)} but {name} has shape {tuple(like.shape)}; "
            "pass a mask with one entry per value"
        )
    return mask if mask.dtype == torch.bool else mask != 0


def zero_unmasked(x: Tensor, mask: Tensor) -> Tensor:
    """`x` where the bool `mask` is True, exactly 0 elsewhere (also where x is NaN or inf)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _count(mask: Tensor, dim: int | tuple[int, ...] | None, like: Tensor) -> Tensor:
    counts = mask.sum() if dim is None else mask.sum(dim=dim)
    return counts.to(like.dtype if like.is_floating_point() else torch.float32)


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of `x` over positions where `mask` is nonzero. x, mask: same shape, e.g. [B, T]."""
    m = as_bool_mask(mask, x)
    kept = zero_unmasked(x, m)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of `x` over counted positions; 0 where nothing is counted. x, mask: same shape."""
    m = as_bool_mask(mask, x)
    total = masked_sum(x, m, dim)
    # The sum is exactly 0 wherever the count is 0, so clamping the count to 1 yields 0, not NaN.
    return total / _count(m, dim, total).clamp(min=1)


def masked_var(
    x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None, unbiased: bool = True
) -> Tensor:
    """Variance of `x` over counted positions.

    unbiased=True divides by n - 1 (Bessel), as torch.var does; a selection of one position (or none) then
    has no spread to estimate and returns 0 rather than NaN.
    """
    m = as_bool_mask(mask, x)
    mean = masked_mean(x, m, dim=dim)
    if dim is not None:
        mean = mean.unsqueeze(dim) if isinstance(dim, int) else _unsqueeze_all(mean, dim, x.dim())
    sq = masked_sum((x - mean) ** 2, m, dim)
    n = _count(m, dim, sq)
    denom = (n - 1) if unbiased else n
    return sq / denom.clamp(min=1)


def _unsqueeze_all(t: Tensor, dims: tuple[int, ...], ndim: int) -> Tensor:
    for d in sorted(d % ndim for d in dims):
        t = t.unsqueeze(d)
    return t


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over all counted positions of the tensor; 0 on unmasked positions.

    mean and var are taken over every counted position at once (the whole batch, not per row); var is
    unbiased. shift_mean=False adds the mean back, rescaling without centring. x, mask: same shape.
    """
    m = as_bool_mask(mask, x)
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return zero_unmasked(out, m)
