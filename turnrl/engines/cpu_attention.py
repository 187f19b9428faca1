"""Attention for the embedded engine on the CPU: SDPA for prefill, two small matmuls for one-token decode steps.

PyTorch's CPU SDPA kernel is slow for a single query token over a long, padded KV cache: profiled on this
repository's 2-core machine (SmolLM2-135M, bf16, 16 rows, 420 cached tokens), it took 62% of a decode step
and a hand-written decode attention cut the step from ~250 ms to ~100 ms. Prefill keeps SDPA, which is
faster there. Grouped-query heads share their KV head by reshaping the query instead of copying the cache.

`use_decode_attention(model)` registers the function with transformers under one name and switches the
model to it; the masks are SDPA's (boolean, or None where nothing is masked).

Grouped-query attention under a mask: transformers' SDPA path copies every KV head once per query head it
serves (`repeat_kv`) whenever a mask is given, since CUDA's fused kernels take no mask with grouped heads. The
CPU flash kernel does (`enable_gqa`): `masked_sdpa` passes the KV as it is there, for the engine's prefill over
cached prefixes and for training (the shared-prefix trainer's suffix lanes run under a mask). Measured on
this repository's 2-core machine (`python benchmarks/cpu_gqa_attention_ab.py`): the same outputs bit for bit,
gradients within float rounding, and a third of the KV memory kept for the backward. `use_masked_sdpa(model)`
switches a training model on the CPU to it. float32 only: with bf16 autocast the main job's update was slower
with it (53 against 36 s, twice), so bf16 calls keep transformers' path.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "turnrl_cpu_decode"
MASKED_NAME = "turnrl_cpu_sdpa"


def masked_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except that on the CPU a masked call with grouped-query heads shares the KV
    heads inside the kernel instead of copying them: query [B, H, Q, D], key/value [B, Hkv, L, D] ->
    ([B, Q, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = key.shape[1] != query.shape[1]
    if (attention_mask is None or not grouped or query.device.type != "cpu" or query.dtype != torch.float32
            or kwargs.get("position_bias") is not None
            or kwargs.get("cache") is not None or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask[:, :, :, :key.shape[-2]], dropout_p=dropout, scale=scaling,
        enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def decode_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [B, H, Q, D], key/value [B, Hkv, L, D] -> ([B, Q, H, D], None)."""
    if query.shape[2] != 1 or module.training:
        return masked_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    b, h, _, d = query.shape
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    q = query.reshape(b, kv_heads, h // kv_heads, d)                  # query heads grouped by their KV head
    scores = torch.matmul(q, key.transpose(2, 3)).float() * scale    # [B, Hkv, G, L]
    if attention_mask is not None:
        mask = attention_mask[:, :, -1:, -key.shape[2]:]             # [B, 1, 1, L]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)                                  # [B, Hkv, G, D]
    return out.reshape(b, 1, h, d), None


def use_decode_attention(model: Any) -> bool:
    """Switch a transformers model to `decode_attention`; False (model unchanged) where it cannot be."""
    return _switch(model, NAME, decode_attention)


def use_masked_sdpa(model: Any) -> bool:
    """Switch a transformers model (on the CPU, under SDPA) to `masked_sdpa`; False (unchanged) where it cannot be."""
    if next(model.parameters()).device.type != "cpu":
        return False
    return _switch(model, MASKED_NAME, masked_sdpa)


def _switch(model: Any, name: str, function: Any) -> bool:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    except ImportError:
        return False
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(name, function)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    try:
        model.set_attn_implementation(name)
    except (ValueError, AttributeError):
        return False
    return model.config._attn_implementation == name
