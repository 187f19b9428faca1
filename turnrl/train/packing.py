"""Packed micro-batches: a micro-batch's rows laid end to end in one row, attention kept inside each row.

A right-padded [B, W] micro-batch computes every matmul on B x W tokens, W its longest row: rows of 512 to
1024 tokens waste about a fifth of the work on padding. Packing concatenates the real tokens of the rows
into one [1, N] row, position ids restarting at each row (they are the rows' own), and runs attention per
segment: on CUDA the variable-length flash-attention kernel (`torch.nn.attention.varlen.varlen_attn`, Dao
2023's varlen API) over the segment boundaries `cu_seqlens`, elsewhere SDPA under a block-diagonal causal
mask built from the same boundaries (for tests; it costs N^2 memory). N is the token count rounded up to a
multiple of `PAD_TO`; the tail is one more segment of padding tokens, so every position holds finite values
(0 * NaN would poison the weight gradients). The outputs go back to the [B, W] layout (`Packed.scatter`),
so losses, masks and metrics see the same tensors as without packing. The same idea as verl's
`use_remove_padding` and HF's flash-attention path for packed position ids. torch 2.11's `varlen_attn` has
no `enable_gqa`; its flash kernel takes fewer key/value heads than query heads as they are (checked against
SDPA by `benchmarks/gpu_packing_check.py`). `trainer.packed_attention: triton` runs turnrl's own kernels instead
(`turnrl.train.flash_kernel`: the same algorithm in Triton, for Hopper's MMA, deterministic backward). On one
H200 (`turnrl bench train`, Qwen2.5-0.5B shape, 64 rows of 512-1024 tokens in one 64k-token micro-batch) an
update ran at 57.0% MFU (6N) packed, 49.8% padded.

Deviations: each row's first position reads the end of the previous row in the packed forward, so its
logprob is set to 0 there, as the padded path does for column 0; a model whose layers include sliding-window
attention is not supported. The model's attention is switched once (`use_packed_attention`): from then on
every forward must be packed (HF's mask creation is skipped for an attention it does not know).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from turnrl.train import flash_kernel
from turnrl.train.batching import to_device

ATTENTION = "turnrl_packed"   # the name under transformers' AttentionInterface (+ "_triton" for those kernels)
KERNELS = ("auto", "flash", "triton")  # trainer.packed_attention
PAD_TO = 128                  # packed length granularity: GEMM-friendly, few distinct shapes


@dataclass
class Packed:
    """Where the real tokens of a [B, W] micro-batch go in the packed [1, N] row."""
    rows: torch.Tensor        # [n] the micro-batch row of each packed token, in packed order
    cols: torch.Tensor        # [n] its column in that row
    kept: torch.Tensor        # [n - rows] packed positions of all tokens but each row's first (scatter keeps these)
    cu_seqlens: torch.Tensor  # [S + 1] int32 segment boundaries: the rows, then the padding tail if any
    max_length: int           # the longest segment
    length: int               # N: n rounded up to a multiple of PAD_TO

    def gather(self, x: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
        """[B, W] -> [1, N]: the real tokens end to end, `fill` in the tail."""
        out = torch.full((1, self.length), fill, dtype=x.dtype, device=x.device)
        out[0, :len(self.rows)] = x[self.rows, self.cols]
        return out

    def scatter(self, y: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """[1, N] -> [B, W] (differentiable): zeros at padding and at each row's first column."""
        out = y.new_zeros(shape)
        out[self.rows[self.kept], self.cols[self.kept]] = y[0, self.kept]
        return out

    def attention_kwargs(self) -> dict[str, Any]:
        """What the model forward passes down to `packed_attention` (HF's flash-attention kwarg names)."""
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_length, "max_length_k": self.max_length}


def pack(lengths: torch.Tensor, device: torch.device) -> Packed:
    """The packing of rows of `lengths` [B], real tokens first in each row. The sizes are known on the host, so
    the index tensors are built on `device` from one small copy (the lengths, the row starts, the segment
    bounds) without a device sync: the micro-batch loop never waits for the GPU, and the host spends
    microseconds here, not the milliseconds of building and pinning token-sized tensors itself."""
    lengths = lengths.to(torch.long).cpu()
    n = int(lengths.sum())
    live = lengths[lengths > 0]
    starts = torch.cumsum(lengths, 0) - lengths
    length = -(-max(n, 1) // PAD_TO) * PAD_TO
    bounds = [0, *torch.cumsum(live, 0).tolist()]
    if length > n:
        bounds.append(length)
    max_length = max(b - a for a, b in zip(bounds, bounds[1:])) if len(bounds) > 1 else 0
    b, r = len(lengths), len(live)
    small = to_device(torch.cat([lengths, starts, live - 1, torch.tensor(bounds, dtype=torch.long)]), device)
    lengths_d, starts_d, rest_d, bounds_d = small.split([b, b, r, len(bounds)])
    # token t of row i at column c: rows[t] = i, cols[t] = t - starts[i]; the kept tokens (c > 0) of the j-th
    # non-empty row are its packed positions after the first: the k-th kept token sits at k + (j + 1)
    rows = torch.repeat_interleave(torch.arange(b, device=device), lengths_d, output_size=n)
    cols = torch.arange(n, device=device) - torch.repeat_interleave(starts_d, lengths_d, output_size=n)
    kept = torch.arange(n - r, device=device) + torch.repeat_interleave(
        torch.arange(1, r + 1, device=device), rest_d, output_size=n - r)
    return Packed(rows, cols, kept, bounds_d.to(torch.int32), max_length, length)


def packed_tokens(lengths: torch.Tensor) -> int:
    """N for rows of `lengths`: what a packed micro-batch computes on."""
    return -(-max(int(lengths.sum()), 1) // PAD_TO) * PAD_TO


def resolve_kernel(kernel: str, config: Any) -> str:
    """`auto`: "triton" where CUDA with Triton runs and `flash_kernel` takes the model's head size (a power of
    two in [16, 256]), else "flash" (the update ran 5-6% faster with triton and bf16 weights than with varlen
    FA2 and fp32 weights in four H100 calls, benchmarks/results/h100_train_arms_*_2026-12-07.json)."""
    if kernel not in KERNELS:
        raise ValueError(f"trainer.packed_attention: {kernel!r} is not one of {', '.join(KERNELS)}")
    if kernel != "auto":
        return kernel
    heads = getattr(config, "num_attention_heads", 0) or 0
    dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
    fits = 16 <= dim <= 256 and not dim & (dim - 1)
    return "triton" if fits and torch.cuda.is_available() and flash_kernel.available(torch.device("cuda")) \
        else "flash"


def use_packed_attention(model: Any, kernel: str = "auto") -> str:
    """Switch `model` (plain or peft) to `packed_attention` with `kernel` on CUDA ("flash": torch's varlen FA2,
    "triton": `flash_kernel`, "auto": `resolve_kernel`); its forwards must then pass `Packed.attention_kwargs`.
    Returns the kernel chosen."""
    from transformers import AttentionInterface

    base = model.get_base_model() if hasattr(model, "peft_config") else model
    kernel = resolve_kernel(kernel, base.config)
    if "sliding_attention" in (getattr(base.config, "layer_types", None) or []):
        raise ValueError("trainer.packing: sliding-window attention layers are not supported; set "
                         "trainer.packing=false")
    name = ATTENTION if kernel == "flash" else f"{ATTENTION}_{kernel}"
    if torch.cuda.is_available():
        _varlen_params()   # read here, not while torch.compile traces the attention
        if kernel == "triton" and not flash_kernel.available(torch.device("cuda")):
            raise ValueError("trainer.packed_attention: triton needs Triton (CUDA builds of torch ship it); set "
                             "trainer.packed_attention: flash")
    AttentionInterface.register(name, functools.partial(packed_attention, kernel=kernel))
    base.set_attn_implementation(name)
    if base.config._attn_implementation != name:
        raise ValueError(f"trainer.packing: {type(base).__name__} cannot switch its attention implementation; "
                         "set trainer.packing=false")
    return kernel


def packed_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     kernel: str = "flash", **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF attention function: query [1, Hq, N, D], key/value [1, Hkv, N, D] -> ([1, N, Hq, D], None),
    causal within each segment of `cu_seq_lens_q` (on CUDA through `kernel`, see `use_packed_attention`)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        raise ValueError("a model under packed attention (trainer.packing) was called without a packed row")
    if query.is_cuda and value.dtype in (torch.float16, torch.bfloat16):
        q, k, v = (x[0].transpose(0, 1).to(value.dtype).contiguous() for x in (query, key, value))
        if kernel == "triton":
            scale = scaling if scaling is not None else q.shape[-1] ** -0.5
            return flash_kernel.packed_attention(q, k, v, cu, int(kwargs["max_length_q"]), scale).unsqueeze(0), None
        out = _varlen(q, k, v, cu, int(kwargs["max_length_q"]), scaling)
        return out.unsqueeze(0), None
    n = query.shape[2]
    segment = torch.searchsorted(cu[1:].long(), torch.arange(n, device=query.device), right=True)
    position = torch.arange(n, device=query.device)
    mask = (segment[:, None] == segment[None, :]) & (position[:, None] >= position[None, :])
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask[None, None],
                                                           scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_length: int,
            scale: float | None) -> torch.Tensor:
    """Causal varlen flash attention on [N, H, D] tensors, over the torch versions' spellings of it."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    extra: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params and q.shape[1] != k.shape[1]:
        extra["enable_gqa"] = True
    return varlen_attn(q, k, v, cu, cu, max_length, max_length, scale=scale, **extra)


_PARAMS: list[frozenset[str]] = []


def _varlen_params() -> frozenset[str]:
    if not _PARAMS:
        from torch.nn.attention.varlen import varlen_attn
        _PARAMS.append(frozenset(inspect.signature(varlen_attn).parameters))
    return _PARAMS[0]
