"""A lean decode step for the transformers engine on the CPU: the model's own operations, without its modules.

A decode step computes one token per running row, so on a CPU much of its time is not arithmetic: transformers'
module calls, the 4-D mask it builds every step from the 2-D one, the views and transposes between them. Measured
on SmolLM2-135M in float32 (`PYTHONPATH=. python benchmarks/cpu_lean_decode_probe.py`,
benchmarks/results/cpu_lean_decode_probe_2026-12-05.json): 32.9-33.0 ms against 36.1-36.5 ms a step at 1 row,
75.5-77.6 against 80.6-83.4 at 8, 101.7-102.5 against 105.5-107.3 at 16, with identical logits.

`LeanDecode` runs the same float32 (or bf16) operations in the same order as transformers' Llama / Qwen2 /
Mistral forward with the engine's CPU decode attention (cpu_attention.py): RMSNorm, rotary embedding, the
attention over the engine's growing KV cache (growing_cache.py), SwiGLU, the final norm and the model's own head
module (cpu_head.py's padded head where installed). It reads the weights from the model's modules at every call,
so weight updates reach it.

`lean_decode(model)` returns it only where the model has that shape (no rotary scaling, no sliding window, no
q/k norms, SiLU, no MLP bias) and where one step on a small batch gives logits equal, bit for bit, to the model's
own forward on the same cache state; otherwise None and the reason, and the engine keeps the model's forward.

With `gemm=True`, a float32 model on a CPU with AVX-512 gets the step with its weight products (head included)
through turnrl's skinny kernel (cpu_gemm.py) instead of `linear`: at 8 rows the body's products take 21 ms
against 30 and the head 3 ms against 8 (`python benchmarks/cpu_gemm_probe.py`). Its sums run in another order
than MKL's, so that step is checked against the model's forward within `KERNEL_TOLERANCE` (relative to the
largest logit) instead of bit for bit, and is not used where it is further off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from turnrl.engines import cpu_gemm

log = logging.getLogger(__name__)

SHAPES = ("llama", "qwen2", "mistral")
KERNEL_TOLERANCE = 1e-4   # largest logit difference from the model's forward, over the largest |logit|
Linear = Callable[..., torch.Tensor]   # (x, weight, bias=None) -> x weight^T + bias, as F.linear


class LeanDecode:
    """One decode step: ids [B], positions [B], attention mask [B, L] (0 = padding, this step included), a cache
    of `GrowingLayer`s -> logits [B, V]; writes the step's keys and values into the cache."""

    def __init__(self, model: Any, linear: Linear = F.linear):
        cfg = model.config
        self.linear = linear
        self.model, self.body = model, model.model
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor,
                 cache: Any) -> torch.Tensor:
        b, d, kv = ids.shape[0], self.head_dim, self.kv_heads
        x = self.body.embed_tokens(ids)
        freqs = positions.float()[:, None] * self.body.rotary_emb.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos()[:, None, :].to(x.dtype), emb.sin()[:, None, :].to(x.dtype)
        padding = (attention_mask == 0)[:, None, None, :]
        for layer, cached in zip(self.body.layers, cache.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = self._rms(x, layer.input_layernorm.weight)
            q = self._rotate(self.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(b, self.heads, d), cos, sin)
            k = self._rotate(self.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(b, kv, d), cos, sin)
            v = self.linear(h, attn.v_proj.weight, attn.v_proj.bias)
            keys, values = cached.update(k.view(b, kv, 1, d), v.view(b, kv, 1, d))
            scores = torch.matmul(q.view(b, kv, self.heads // kv, d), keys.transpose(2, 3)).float() * attn.scaling
            scores = scores.masked_fill(padding, torch.finfo(scores.dtype).min)
            out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values).reshape(b, self.heads * d)
            x = x + self.linear(out, attn.o_proj.weight, attn.o_proj.bias)
            h = self._rms(x, layer.post_attention_layernorm.weight)
            x = x + self.linear(F.silu(self.linear(h, mlp.gate_proj.weight)) * self.linear(h, mlp.up_proj.weight),
                                mlp.down_proj.weight)
        h = self._rms(x, self.body.norm.weight)
        if self.linear is F.linear:
            return self.model.lm_head(h)      # the model's own head module (cpu_head.py's padded one)
        head = self.model.lm_head
        return self.linear(h, head.weight, head.bias)


def unsupported(model: Any) -> str:
    """Why `LeanDecode` cannot stand in for `model`'s forward; '' if it can (the equality check aside)."""
    cfg = getattr(model, "config", None)
    body = getattr(model, "model", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SHAPES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {', '.join(SHAPES)}"
    if body is None or not hasattr(body, "layers") or not hasattr(model, "lm_head") or hasattr(model, "peft_config"):
        return "not a plain causal-LM module tree (model.model.layers, lm_head)"
    rotary = getattr(body, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") != "default" \
            or float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        return "its rotary embedding is scaled"
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False) \
            or getattr(cfg, "pretraining_tp", 1) != 1:
        return "its MLP is not a plain SwiGLU"
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []) or (
            getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)):
        return "it has sliding-window attention"
    layer = body.layers[0]
    if hasattr(layer.self_attn, "q_norm") or not hasattr(layer.self_attn, "scaling"):
        return "its attention is not Llama's (q/k norms, or no scaling attribute)"
    return ""


def lean_decode(model: Any, cache_factory: Any, gemm: bool = True) -> tuple[LeanDecode | None, str]:
    """`LeanDecode` for `model` if it is supported and matches the model's forward bit for bit on a small batch
    (`cache_factory()` makes an empty cache as the engine does); else (None, why). With `gemm`, the step through
    the skinny kernel where it can run and stays within `KERNEL_TOLERANCE` of the forward (the module docstring)."""
    why = unsupported(model)
    if why:
        return None, why
    lean = LeanDecode(model)
    reference = _step_logits(model, None, cache_factory)
    logits = _step_logits(model, lean, cache_factory)
    if not torch.equal(reference, logits):
        diff = (reference.float() - logits.float()).abs().max().item()
        return None, f"its logits differ from the model's forward (max {diff:.2e})"
    if gemm:
        kernel, why = kernel_for(model)
        if kernel is not None:
            fast = LeanDecode(model, kernel)
            diff = (_step_logits(model, fast, cache_factory) - reference).abs().max().item()
            scale = max(1.0, reference.abs().max().item())
            if diff <= KERNEL_TOLERANCE * scale:
                return fast, ""
            why = f"its logits differ from the forward by {diff:.2e} (largest |logit| {scale:.1f})"
        log.info("lean decode step: weight products through linear, not the skinny kernel: %s", why)
    return lean, ""


def kernel_for(model: Any) -> tuple[Linear | None, str]:
    """The skinny kernel for `model`'s decode products, or (None, why) where it is not used."""
    weight = next(model.parameters())
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None, f"the model is {weight.dtype} on {weight.device.type} (the kernel is for float32 on a CPU)"
    if not cpu_gemm.avx512():
        return None, "this CPU has no AVX-512 (the kernel was measured with it only)"
    return cpu_gemm.load()


def _step_logits(model: Any, lean: LeanDecode | None, cache_factory: Any) -> torch.Tensor:
    """The logits of one decode step over a freshly prefilled cache: through `lean`, or the model's forward
    where `lean` is None."""
    device = next(model.parameters()).device
    prompt = torch.tensor([[0, 0, 11, 12, 13, 14], [21, 22, 23, 24, 25, 26]], device=device)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], device=device)
    positions = mask.sum(1) - 1
    ids = torch.tensor([31, 32], device=device)
    with torch.no_grad():
        cache = cache_factory()
        model(input_ids=prompt, attention_mask=mask[:, :-1], past_key_values=cache, use_cache=True)
        if lean is not None:
            return lean(ids, positions, mask, cache)
        return model(input_ids=ids[:, None], attention_mask=mask, position_ids=positions[:, None],
                     past_key_values=cache, use_cache=True).logits[:, -1]
