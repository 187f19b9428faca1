"""A functional forward of Llama-family decoders (Llama, Qwen2, Qwen3, Mistral) over a slot KV cache.

The cache is preallocated: per layer one key and one value tensor [slots, kv_heads, max_len, head_dim], so a
request owns one slot for its whole life and nothing is concatenated or reallocated while decoding. The
forward reads the transformers model's own parameter storage (no copies: q/k/v and gate/up projections are
re-pointed into one stacked tensor each, so each is one GEMM), so an in-place weight update reaches it, and
a captured CUDA graph that reads it stays valid.

- prefill: right-padded prompts [n, T] -> keys/values written to the n slots' positions [0, T) -> logits of
  each prompt's last token. Causal attention through SDPA (grouped-query heads, no mask tensor).
- decode, one token for each of the first B slots: the layer is split in pure functions (`pre_attention`,
  `post_attention`, `head` in the engine) around the cache write, so torch.compile sees no mutation. The
  attention reads only the first `n_kv` positions of the cache (a bucket above the longest live sequence)
  with a length mask; grouped-query heads share one read of each key (no repeat_kv copy).

The arithmetic mirrors transformers' eager path (RMSNorm in float32, rotary tables computed the same way,
softmax in float32), so float32 greedy decoding matches `model.generate`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from turnrl.engines.fast.cache_kernel import write_kv
from turnrl.exact import model as exact_model
from turnrl.exact import ops as exact_ops

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class LayerWeights(NamedTuple):
    """One decoder layer's parameters (the model's own storage; biases and q/k norms may be None)."""
    ln1: torch.Tensor          # [hidden]
    qkv: torch.Tensor          # [(heads + 2 * kv_heads) * head_dim, hidden]: q_proj, k_proj, v_proj stacked
    qkv_bias: torch.Tensor | None
    o: torch.Tensor            # [hidden, heads * head_dim]
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None
    ln2: torch.Tensor          # [hidden]
    gate_up: torch.Tensor      # [2 * intermediate, hidden]: gate_proj, up_proj stacked
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor         # [hidden, intermediate]
    down_bias: torch.Tensor | None


class Shape(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scaling: float


def unsupported_reason(model: Any, max_len: int) -> str | None:
    """Why this model cannot run on the slot decoder, or None if it can."""
    config = model.config
    kind = getattr(config, "model_type", "?")
    if kind not in SUPPORTED_MODEL_TYPES:
        return f"model type {kind!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (only silu)"
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return "no rotary embedding module with inv_freq"
    if getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):
        return f"rope type {rotary.rope_type!r} (its frequencies depend on the sequence length)"
    for layer in inner.layers:
        window = getattr(layer.self_attn, "sliding_window", None)
        if window is not None and window < max_len:
            return f"sliding-window attention ({window} < max_len {max_len})"
    return None


class SlotDecoder:
    """The model's forward over `slots` x `max_len` preallocated KV slots."""

    def __init__(self, model: Any, slots: int, max_len: int, exact: bool = False):
        reason = unsupported_reason(model, max_len)
        if reason is not None:
            raise ValueError(f"the fast engine does not support this model: {reason}")
        inner, config = model.model, model.config
        attn = inner.layers[0].self_attn
        self.shape = Shape(config.num_attention_heads, config.num_key_value_heads, attn.head_dim,
                           float(config.rms_norm_eps), float(attn.scaling))
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.lm_head_bias = getattr(model.lm_head, "bias", None)
        self.layers = [_layer_weights(layer) for layer in inner.layers]
        self.slots, self.max_len = slots, max_len
        device, dtype = self.embed.device, self.embed.dtype
        rotary = inner.rotary_emb
        self.exact = exact   # turnrl.exact: batch-invariant ops, the trainer's forward (`exact_logprobs`)
        if exact:
            self.cos, self.sin = exact_model.rope_tables(rotary, max_len, dtype)
        else:
            freqs = torch.arange(max_len, device=device, dtype=torch.float32)[:, None] * rotary.inv_freq.float()[None]
            angles = torch.cat((freqs, freqs), dim=-1)
            self.cos = (angles.cos() * rotary.attention_scaling).to(dtype)   # [max_len, head_dim]
            self.sin = (angles.sin() * rotary.attention_scaling).to(dtype)
        shape = (slots, self.shape.kv_heads, max_len, self.shape.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers]
        self.heads_index = torch.arange(self.shape.kv_heads, device=device)
        self.fused_write = False   # DecodeStep turns it on where the Triton kernels run

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    # -- prefill (eager) ----------------------------------------------------------------------------
    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor | None = None,
                total: int = 0) -> torch.Tensor:
        """ids [n, T] right-padded, lengths [n], slots [n] (device) -> logits of each last token [n, V] float32.

        With `starts` [n], row i's tokens go at positions starts[i].. of its slot, whose positions [0, starts[i])
        already hold the KV of the tokens before them (a prefix-cache hit); `total` is max(starts + lengths)."""
        if self.exact:
            if starts is not None:
                raise ValueError("the exact prefill starts at position 0 (engine.exact has no prefix cache)")
            return self.prefill_exact(ids, lengths, slots)
        if starts is not None:
            return self.prefill_after(ids, lengths, slots, starts, total)
        n, width = ids.shape
        cos, sin = self.cos[:width][None, :, None], self.sin[:width][None, :, None]
        x = F.embedding(ids, self.embed)
        for w, keys, values in zip(self.layers, self.keys, self.values):
            q, k, v = pre_attention(x, w, cos, sin, self.shape)            # [n, T, h, D]
            k, v = k.transpose(1, 2), v.transpose(1, 2)                     # [n, kv, T, D]
            keys[slots, :, :width] = k
            values[slots, :, :width] = v
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, scale=self.shape.scaling,
                                                 enable_gqa=self.shape.heads != self.shape.kv_heads)
            x = post_attention(x, out.transpose(1, 2).reshape(n, width, -1), w, self.shape)
        last = x[torch.arange(n, device=x.device), lengths - 1]
        return head(last, self.norm, self.lm_head, self.lm_head_bias, self.shape.eps)

    def prefill_after(self, ids: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
                      total: int, captured: bool = False) -> torch.Tensor:
        """`prefill` of rows that continue cached KV: each new token attends to its slot's positions up to its own.
        `captured`: this call (or the graph captured after it) runs many times, so the attention may use SDPA's own
        choice, whose per-shape setup is paid once (`masked_attention`)."""
        n, width = ids.shape
        positions = (starts[:, None] + torch.arange(width, device=ids.device)[None]).clamp(max=self.max_len - 1)
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]    # [n, T, 1, D]
        bias = additive_mask(positions, total, self.embed.dtype)                        # [n, 1, T, total]
        x = F.embedding(ids, self.embed)
        for w, keys, values in zip(self.layers, self.keys, self.values):
            q, k, v = pre_attention(x, w, cos, sin, self.shape)            # [n, T, h, D]
            keys[slots[:, None], :, positions] = k                          # padding lands past each row's end
            values[slots[:, None], :, positions] = v
            out = masked_attention(q.transpose(1, 2), keys[slots, :, :total], values[slots, :, :total], bias,
                                   self.shape.scaling, captured)
            x = post_attention(x, out.transpose(1, 2).reshape(n, width, -1), w, self.shape)
        last = x[torch.arange(n, device=x.device), lengths - 1]
        return head(last, self.norm, self.lm_head, self.lm_head_bias, self.shape.eps)

    def copy_prefix(self, sources: torch.Tensor, targets: torch.Tensor, length: int) -> None:
        """Copy positions [0, length) of the slots `sources` [m] to the slots `targets` [m] (every layer)."""
        for keys, values in zip(self.keys, self.values):
            keys[targets, :, :length] = keys[sources, :, :length]
            values[targets, :, :length] = values[sources, :, :length]

    def prefill_exact(self, ids: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`prefill` through the exact forward: every prompt token's keys, values and logits are the bits the
        trainer's `exact_logprobs` computes for it, whatever the other prompts."""
        n, width = ids.shape
        cos, sin = self.cos[:width][None, :, None], self.sin[:width][None, :, None]
        qpos = torch.arange(width, device=ids.device).expand(n, width)
        qpos = qpos.repeat_interleave(self.shape.heads // self.shape.kv_heads, dim=1)
        x = F.embedding(ids, self.embed)
        for w, keys, values in zip(self.layers, self.keys, self.values):
            q, k, v = exact_model.pre_attention(x, w, cos, sin, self.shape)
            k, v = k.transpose(1, 2), v.transpose(1, 2)                     # [n, kv, T, D]
            keys[slots, :, :width] = k
            values[slots, :, :width] = v
            out = exact_ops.attention(exact_model.grouped(q, self.shape.kv_heads), exact_ops.pad_keys(k),
                                      exact_ops.pad_keys(v), qpos, self.shape.scaling)
            x = exact_model.post_attention(x, exact_model.ungrouped(out, width), w, self.shape)
        last = x[torch.arange(n, device=x.device), lengths - 1]
        return exact_ops.head_logits(last, self.norm, self.lm_head, self.lm_head_bias, self.shape.eps)

    # -- decode pieces --------------------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
              rotate: bool = False) -> None:
        """Store one token's key/value [B, kv, D] for slots rows [B] at their positions pos [B] (with
        `fused_write`, one Triton kernel for both: cache_kernel.py; `rotate`: k comes unrotated, and that kernel
        applies the rotary embedding of its position)."""
        if self.fused_write:
            rotary = (self.cos, self.sin) if rotate else (None, None)
            write_kv(k, v, self.keys[layer], self.values[layer], rows, pos, *rotary)
            return
        if rotate:
            raise ValueError("a rotating cache write needs the write kernel (fused_write)")
        index = (rows[:, None], self.heads_index[None, :], pos[:, None])
        self.keys[layer].index_put_(index, k)
        self.values[layer].index_put_(index, v)


def _layer_weights(layer: Any) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp

    def norm(name: str) -> torch.Tensor | None:
        module = getattr(attn, name, None)
        return None if module is None else module.weight
    qkv, qkv_bias = _stack(attn.q_proj, attn.k_proj, attn.v_proj)
    gate_up, gate_up_bias = _stack(mlp.gate_proj, mlp.up_proj)
    return LayerWeights(layer.input_layernorm.weight, qkv, qkv_bias, attn.o_proj.weight,
                        getattr(attn.o_proj, "bias", None), norm("q_norm"), norm("k_norm"),
                        layer.post_attention_layernorm.weight, gate_up, gate_up_bias, mlp.down_proj.weight,
                        getattr(mlp.down_proj, "bias", None))


def _stack(*linears: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linears that read the same input: one GEMM instead of several.

    The linears' parameters become views into the stacked tensor, so there is still one copy of each weight
    and an in-place update of a parameter (update_weights, a trainer's copy_) lands in the stacked one."""
    stacked = []
    for attr in ("weight", "bias"):
        params = [getattr(linear, attr, None) for linear in linears]
        if any(p is None for p in params):
            stacked.append(None)
            continue
        # a Parameter, so that torch.compile keeps its shape static like the other weights'
        joint = torch.nn.Parameter(torch.cat([p.detach() for p in params]), requires_grad=False)
        start = 0
        for p in params:
            p.data = joint.data[start:start + p.shape[0]]
            start += p.shape[0]
        stacked.append(joint)
    return stacked[0], stacked[1]


# -- pure functions (compiled on the GPU) ---------------------------------------------------------------
def additive_mask(positions: torch.Tensor, total: int, dtype: torch.dtype) -> torch.Tensor:
    """positions [n, T] -> [n, 1, T, total]: 0 where a key position <= the query's, -inf elsewhere. Built once per
    prefill, as an additive mask (with a boolean one and grouped heads, SDPA on an H100 spent 0.63 ms of host
    time a layer choosing and preparing its kernel, against 0.02 ms), its rows padded to 16 positions (the
    memory-efficient kernel's alignment) and sliced back."""
    n, width = positions.shape
    padded = -(-total // 16) * 16
    visible = torch.arange(total, device=positions.device)[None, None] <= positions[:, :, None]   # [n, T, total]
    bias = torch.zeros(n, 1, width, padded, device=positions.device, dtype=dtype)[..., :total]
    return bias.masked_fill_(~visible[:, None], float("-inf"))


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scaling: float,
                     captured: bool = False) -> torch.Tensor:
    """q [n, heads, T, D] against k/v [n, kv_heads, S, D] under the additive mask bias [n, 1, T, S] -> [n, heads, T, D].

    SDPA left to choose took the cuDNN backend on an H100 (torch 2.11), which builds a plan for every new shape:
    ~50 ms of host time for a prefill's 24 layers the first time, 0.6-0.9 ms later, with 2.3-6.3 ms of device time
    (benchmarks/fast_prefix/sdpa_probe.py, `h100_sdpa_probe_2026-12-05.txt`). An eager admission sees new sizes all
    the time, so on CUDA it names the memory-efficient kernel instead: 1.4-1.9 ms of host time for any shape, but
    5-16 ms of device time (the keys and values repeated per query head: that kernel has no grouped heads).
    `captured` (an admission replayed from a CUDA graph, admit.py): SDPA's choice, set up once per graph. The kernel
    is named rather than chosen with `sdpa_kernel`, which sets process-wide flags (a trainer may attend meanwhile)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if q.is_cuda and not captured:
        if heads != kv_heads:
            k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias.expand(-1, heads, -1, -1), False, scale=scaling)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scaling, enable_gqa=heads != kv_heads)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: statistics in float32, the scale applied in the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def pre_attention(x: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor,
                  shape: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., hidden] -> q [..., heads, D], k and v [..., kv_heads, D], rotary applied (cos/sin [..., 1, D])."""
    q, k, v = project_qkv(x, w, shape)
    return rope(q, cos, sin), rope(k, cos, sin), v


def project_qkv(x: torch.Tensor, w: LayerWeights, shape: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pre_attention` before the rotary embedding (q and k normed where the model has q/k norms)."""
    h = rms_norm(x, w.ln1, shape.eps)
    lead = x.shape[:-1]
    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    qkv = F.linear(h, w.qkv, w.qkv_bias)
    q = qkv[..., :q_width].reshape(*lead, shape.heads, shape.head_dim)
    k = qkv[..., q_width:q_width + kv_width].reshape(*lead, shape.kv_heads, shape.head_dim)
    v = qkv[..., q_width + kv_width:].reshape(*lead, shape.kv_heads, shape.head_dim)
    if w.q_norm is not None:
        q, k = rms_norm(q, w.q_norm, shape.eps), rms_norm(k, w.k_norm, shape.eps)
    return q, k, v


def post_attention(x: torch.Tensor, attn: torch.Tensor, w: LayerWeights, shape: Shape) -> torch.Tensor:
    """The residual stream after the attention output projection and the MLP block."""
    x = x + F.linear(attn, w.o, w.o_bias)
    return x + mlp_block(x, w, shape)


def mlp_block(x: torch.Tensor, w: LayerWeights, shape: Shape) -> torch.Tensor:
    """The MLP's output (its own norm included) for the residual stream x, before its residual sum."""
    gate, up = F.linear(rms_norm(x, w.ln2, shape.eps), w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w.down, w.down_bias)


def post_attention_parts(x: torch.Tensor, attn: torch.Tensor, w: LayerWeights,
                         shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """`post_attention` without its two residual sums: the output projection o and the MLP's output m
    (post_attention is (x + o) + m). A decode step adds them at the next layer's norm: under
    torch.compile a sum `x + product` whose result leaves the graph becomes cuBLAS's addmm, which first copies x
    into its output (a device-to-device copy a product, 48 a step for 24 layers)."""
    o = F.linear(attn, w.o, w.o_bias)
    return o, mlp_block(x + o, w, shape)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, n_kv: int,
                     scaling: float) -> torch.Tensor:
    """q [B, heads, D] of the first B slots against their cached keys/values [slots, kv, max_len, D], positions
    [0, pos] of each row (pos [B]), looking at the first n_kv positions only -> [B, heads * D]."""
    batch, heads, dim = q.shape
    kv_heads = keys.shape[1]
    k, v = keys[:batch, :, :n_kv], values[:batch, :, :n_kv]
    scores = torch.matmul(q.view(batch, kv_heads, heads // kv_heads, dim), k.transpose(-1, -2)) * scaling
    visible = torch.arange(n_kv, device=q.device)[None, :] <= pos[:, None]          # [B, n_kv]
    scores = scores.float().masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v).reshape(batch, heads * dim)


def exact_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                           n_kv: int, shape: Shape) -> torch.Tensor:
    """`decode_attention` through the exact forward: q [B, heads, D] over the first n_kv cached positions."""
    batch, heads, dim = q.shape
    group = heads // shape.kv_heads
    qpos = pos[:, None].expand(batch, group)
    out = exact_ops.attention(q.view(batch, shape.kv_heads, group, dim), keys[:batch, :, :n_kv],
                              values[:batch, :, :n_kv], qpos, shape.scaling)
    return out.reshape(batch, heads * dim)


def head(x: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, bias: torch.Tensor | None,
         eps: float) -> torch.Tensor:
    """Final norm and LM head -> float32 logits (computed in the model dtype, as transformers does)."""
    return model_logits(x, norm, lm_head, bias, eps).float()


def model_logits(x: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, bias: torch.Tensor | None,
                 eps: float) -> torch.Tensor:
    """`head` before the float32 cast: logits in the model dtype."""
    return F.linear(rms_norm(x, norm, eps), lm_head, bias)
