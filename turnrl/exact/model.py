"""The exact forward of Llama-family decoders (Llama, Qwen2, Qwen3, Mistral), shared by engine and trainer.

`pre_attention` / `post_attention` are one decoder layer around its attention, written with the
batch-invariant ops of `turnrl.exact.ops`; the fast engine calls them in its prefill and decode steps
(turnrl/engines/fast) and `exact_logprobs` calls them over whole right-padded rows for the trainer. Both
sides use the same weights in the engine's dtype: q/k/v and gate/up stacked into one matrix each (as the
engine stores them, so the GEMMs have the same shapes), LoRA merged by `merged_weight`, the exact
computation the weight sync uses (`turnrl.train.policy.export_weights`), then cast.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from turnrl.exact import ops

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class Shape(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scaling: float


def pre_attention(x: torch.Tensor, w: Any, cos: torch.Tensor, sin: torch.Tensor,
                  shape: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., hidden] -> q [..., heads, D], k and v [..., kv_heads, D], rotary applied (cos/sin [..., 1, D]).
    `w` has the fields of `turnrl.engines.fast.decoder.LayerWeights`."""
    h = ops.rms_norm(x, w.ln1, shape.eps)
    lead = x.shape[:-1]
    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    qkv = ops.linear(h, w.qkv, w.qkv_bias)
    q = qkv[..., :q_width].reshape(*lead, shape.heads, shape.head_dim)
    k = qkv[..., q_width:q_width + kv_width].reshape(*lead, shape.kv_heads, shape.head_dim)
    v = qkv[..., q_width + kv_width:].reshape(*lead, shape.kv_heads, shape.head_dim)
    if w.q_norm is not None:
        q, k = ops.rms_norm(q, w.q_norm, shape.eps), ops.rms_norm(k, w.k_norm, shape.eps)
    return ops.rope(q, cos, sin), ops.rope(k, cos, sin), v


def post_attention(x: torch.Tensor, attn: torch.Tensor, w: Any, shape: Any) -> torch.Tensor:
    """The residual stream after the attention output projection and the MLP block."""
    x = x + ops.linear(attn, w.o, w.o_bias)
    gate, up = ops.linear(ops.rms_norm(x, w.ln2, shape.eps), w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
    return x + ops.linear(ops.silu_mul(gate, up), w.down, w.down_bias)


def grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [R, T, heads, D] -> [R, kv_heads, T * group, D]: each key/value head's queries, position-major."""
    r, t, heads, d = q.shape
    return q.view(r, t, kv_heads, heads // kv_heads, d).permute(0, 2, 1, 3, 4).reshape(r, kv_heads, -1, d)


def ungrouped(out: torch.Tensor, t: int) -> torch.Tensor:
    """[R, kv_heads, T * group, D] -> [R, T, heads * D]."""
    r, kv, m, d = out.shape
    return out.view(r, kv, t, m // t, d).permute(0, 2, 1, 3, 4).reshape(r, t, -1)


def rope_tables(rotary: Any, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [length, head_dim] from the rotary module's config: its inv_freq buffer is cast with the model
    (to bf16 in a bf16 engine), so the frequencies are recomputed in float32 for both sides."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = getattr(rotary, "rope_type", "default")
    init = rotary.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
    inv_freq, scaling = init(rotary.config)
    return ops.rope_tables(inv_freq.float().to(rotary.inv_freq.device), float(scaling), length, dtype)


# -- the trainer's side -------------------------------------------------------------------------------------
def unsupported_reason(model: Any) -> str | None:
    """Why `model` (plain or peft) cannot run the exact forward, or None."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    config = base.config
    kind = getattr(config, "model_type", "?")
    if kind not in MODEL_TYPES:
        return f"model type {kind!r} (supported: {', '.join(MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (only silu)"
    rotary = getattr(getattr(base, "model", None), "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):
        return "no fixed rotary embedding"
    if getattr(base.lm_head, "bias", None) is not None:
        return "an LM head with a bias"
    return None


def merged_weight(module: Any) -> torch.Tensor:
    """A linear module's weight with its active LoRA adapters merged: W + (B @ A) * scale in W's dtype (the
    float32 master). `turnrl.train.policy.export_weights` sends exactly this to the engines."""
    base = getattr(module, "base_layer", None)
    if base is None or not hasattr(module, "lora_A"):
        return module.weight
    weight = base.weight
    if getattr(module, "disable_adapters", False):
        return weight
    for adapter in module.active_adapters:
        if adapter in module.lora_A:
            a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
            delta = ((b.float() @ a.float()) * module.scaling[adapter]).to(weight.dtype)
            weight = weight + (delta.T if getattr(module, "fan_in_fan_out", False) else delta)
    return weight


def _bias(*modules: Any) -> torch.Tensor | None:
    biases = [getattr(getattr(m, "base_layer", m), "bias", None) for m in modules]
    return None if any(b is None for b in biases) else torch.cat(biases)


class _Layer(NamedTuple):
    ln1: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    ln2: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def _layer(layer: Any, dtype: torch.dtype) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype)

    def norm(name: str) -> torch.Tensor | None:
        module = getattr(attn, name, None)
        return None if module is None else cast(module.weight)
    qkv = torch.cat([merged_weight(m).to(dtype) for m in (attn.q_proj, attn.k_proj, attn.v_proj)])
    gate_up = torch.cat([merged_weight(m).to(dtype) for m in (mlp.gate_proj, mlp.up_proj)])
    return _Layer(cast(layer.input_layernorm.weight), qkv, cast(_bias(attn.q_proj, attn.k_proj, attn.v_proj)),
                  merged_weight(attn.o_proj).to(dtype), cast(_bias(attn.o_proj)), norm("q_norm"), norm("k_norm"),
                  cast(layer.post_attention_layernorm.weight), gate_up, cast(_bias(mlp.gate_proj, mlp.up_proj)),
                  merged_weight(mlp.down_proj).to(dtype), cast(_bias(mlp.down_proj)))


def exact_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                   temperature: float, dtype: torch.dtype, select: torch.Tensor | None = None,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs [B, T], entropy [B, T] or None) like `turnrl.train.policy.forward_logprobs`, through the exact
    forward in `dtype`: column i holds log p(token_i | tokens < i) where `select` [B, T] marks (all columns
    but 0 without it), 0 elsewhere. Rows must be right-padded with positions 0, 1, ... (the ledger's layout)."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"engine.exact: the exact forward does not support this model: {reason}")
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    inner, config = base.model, base.config
    b, t = input_ids.shape
    steps = torch.arange(t, device=input_ids.device)[None]
    if not bool(((position_ids == steps) | (attention_mask == 0)).all()):
        raise ValueError("engine.exact: rows must be right-padded with positions 0, 1, ... (packed or offset "
                         "positions are not supported)")
    attn0 = inner.layers[0].self_attn
    shape = Shape(config.num_attention_heads, config.num_key_value_heads, attn0.head_dim,
                  float(config.rms_norm_eps), float(attn0.scaling))
    cos, sin = rope_tables(inner.rotary_emb, t, dtype)
    cos, sin = cos[None, :, None], sin[None, :, None]
    qpos = steps.expand(b, t).repeat_interleave(shape.heads // shape.kv_heads, dim=1)
    x = F.embedding(input_ids, inner.embed_tokens.weight).to(dtype)
    for layer in inner.layers:
        w = _layer(layer, dtype)
        q, k, v = pre_attention(x, w, cos, sin, shape)
        keys, values = ops.pad_keys(k.transpose(1, 2)), ops.pad_keys(v.transpose(1, 2))
        out = ops.attention(grouped(q, shape.kv_heads), keys, values, qpos, shape.scaling)
        x = post_attention(x, ungrouped(out, t), w, shape)
    pick = torch.ones((b, t - 1), dtype=torch.bool, device=x.device) if select is None else select[:, 1:].bool()
    hidden = ops.rms_norm(x[:, :-1][pick], inner.norm.weight.to(dtype), shape.eps)
    lp, ent = ops.head_logprobs(hidden, base.lm_head.weight.to(dtype), input_ids[:, 1:][pick], temperature or 1.0)
    zero = torch.zeros((b, 1), dtype=torch.float32, device=x.device)

    def spread(values: torch.Tensor) -> torch.Tensor:
        return torch.cat([zero, zero.new_zeros((b, t - 1)).masked_scatter(pick, values)], dim=1)
    return spread(lp), spread(ent) if with_entropy else None
