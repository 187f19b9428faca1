"""q/k/v and gate/up as one cuBLAS GEMM each, with rotary and SwiGLU in kernels that own the seams
(`trainer.fused_projections`).

A decoder layer projects one normalised input three times for attention (q, k, v) and twice for its MLP (gate,
up). Run one by one, each projection is its own GEMM, and in the backward each writes its own input gradient
for the norm's backward to read and sum: with Qwen2.5-0.5B's shapes, three [tokens, 896] gradients for q, k, v
(two from 128-wide GEMMs far below the GPU's rate) and two for gate and up. `trainer.fuse_linears` fuses them in
the compiled graph, and on an H100 it saved 4.5 ms of GEMMs and 3.7 ms of norm backward an update, but lost
19 ms in the backward's `cat` of the parts' gradients, which inductor lowered into the SiLU and rotary backward
kernels as masked loads (2026-12-07, benchmarks/results/h100_train_call_f_*: those kernels took 27.9 and 12.3 ms
against 19.5 and 1.7).

Here the seams are two custom ops whose backward writes the fused gradient whole, so no `cat` is left:
- attention: y = x [Wq; Wk; Wv]^T (+ the biases) in one GEMM, then `rotary_split` reads y once and writes q and k
  rotated and v, in the [tokens, heads, head size] layout the packed attention kernel reads
  (`turnrl.train.flash_kernel`); its backward, `rotary_merge`, writes dy [tokens, (H + 2 KV) D] from dq, dk, dv,
  so the input gradient and the weight gradients are one GEMM each;
- MLP: y = x [Wg; Wu]^T in one GEMM, `swiglu` writes h = silu(g) u; its backward writes dy = (dg | du) whole.
The weights stay separate parameters (names, checkpoints, weight sync unchanged); their concatenation costs a
copy of the layer's projection weights per forward (19 MB for the 0.5B shape). The kernels round where eager
bf16 torch rounds; the fused GEMMs sum in another order than the separate ones, so results agree with the
unfused layer to rounding, not bit for bit.

The attention part runs where the model runs turnrl's packed Triton attention (`trainer.packing` with
`packed_attention: triton`), the MLP part wherever the MLP is a plain SwiGLU; both on CUDA tensors of one 16-bit
dtype with plain nn.Linear projections (not LoRA- or quantization-wrapped), else the module's own forward runs.
On an H100 (2026-12-08, benchmarks/results/h100_projections_*): the bench's update 0.3085 s against 0.3128 with
the separate projections (norm backward -3.6 ms, GEMMs -1.5, the SwiGLU and rotary kernels +2.2 against inductor's
fused ones); `trainer.fused_projections: auto` turns it on where it runs (`projections_wanted`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from turnrl.train import flash_kernel
from turnrl.train.packing import ATTENTION
from turnrl.train.swiglu_kernel import plain_linear, plain_swiglu, runs_fused, switch_forward

ROTARY = (64, 4, False)            # (tokens, warps, heads first) of a rotary program (one head each;
#                                    benchmarks/projection_probe.py times others)
SWIGLU_BLOCK = (8, 256, 4)         # (tokens, columns, warps) of a SwiGLU program
_INTERPRET = False                 # tests: run the kernels on CPU tensors (under Triton's interpreter)


@functools.cache
def _kernels() -> Any:
    from turnrl.train import projection_triton
    return projection_triton


def _check_rotary(y: torch.Tensor, cos: torch.Tensor, heads: int, kv_heads: int) -> int:
    if y.dim() != 2 or cos.dim() != 2 or cos.shape[0] != y.shape[0] or y.shape[1] % (heads + 2 * kv_heads):
        raise ValueError(f"rotary_split: y {tuple(y.shape)} must be [T, (H + 2 KV) D] and cos, sin [T, D] "
                         f"(H {heads}, KV {kv_heads})")
    dim = y.shape[1] // (heads + 2 * kv_heads)
    if cos.shape[1] != dim or dim % 2 or dim & (dim - 1):
        raise ValueError(f"rotary_split: the rotary width {cos.shape[1]} must be the head size {dim}, a power of two "
                         "(partial rotary embeddings are not fused)")
    return dim


def _rotary_launch(t: int, heads: int) -> tuple[tuple[int, int], dict[str, Any]]:
    tokens, warps, heads_first = ROTARY
    blocks = -(-t // tokens)
    heads_first = heads_first and blocks < 1 << 16   # the grid's second axis holds at most 65535
    return (heads, blocks) if heads_first else (blocks, heads), {"BLOCK_T": tokens, "HEADS_FIRST": heads_first,
                                                                  "num_warps": warps}


def rotary_split(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                 kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [T, H, D], k [T, KV, D], v [T, KV, D]) from y [T, (H + 2 KV) D]: q and k rotated by cos, sin [T, D]."""
    dim = _check_rotary(y, cos, heads, kv_heads)
    t = y.shape[0]
    q, k, v = y.new_empty((t, heads, dim)), y.new_empty((t, kv_heads, dim)), y.new_empty((t, kv_heads, dim))
    if t:
        grid, options = _rotary_launch(t, heads + 2 * kv_heads)
        _kernels().rotary_split[grid](y, cos, sin, q, k, v, t, H=heads, KV=kv_heads, D=dim, WIDEN=not y.is_cuda,
                                      **options)
    return q, k, v


def rotary_merge(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """The gradient of `rotary_split`'s y [T, (H + 2 KV) D] from those of q, k, v."""
    t, heads, dim = dq.shape
    kv_heads = dk.shape[1]
    dy = dq.new_empty((t, (heads + 2 * kv_heads) * dim))
    if t:
        grid, options = _rotary_launch(t, heads + 2 * kv_heads)
        _kernels().rotary_merge[grid](dq.contiguous(), dk.contiguous(), dv.contiguous(), cos, sin, dy, t, H=heads,
                                      KV=kv_heads, D=dim, WIDEN=not dq.is_cuda, **options)
    return dy


def _swiglu_grid(t: int, n: int) -> tuple[int, int]:
    return -(-t // SWIGLU_BLOCK[0]), -(-n // SWIGLU_BLOCK[1])


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """h [T, N] = silu(g) * u for y [T, 2N] = (g | u)."""
    t, n = y.shape[0], y.shape[1] // 2
    h = y.new_empty((t, n))
    if t:
        _kernels().swiglu[_swiglu_grid(t, n)](y, h, t, N=n, BLOCK_T=SWIGLU_BLOCK[0], BLOCK_N=SWIGLU_BLOCK[1],
                                              WIDEN=not y.is_cuda, num_warps=SWIGLU_BLOCK[2])
    return h


def swiglu_back(dh: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """dy [T, 2N] = (dg | du) of `swiglu` for dh [T, N]."""
    t, n = dh.shape
    dy = y.new_empty((t, 2 * n))
    if t:
        _kernels().swiglu_back[_swiglu_grid(t, n)](dh.contiguous(), y, dy, t, N=n, BLOCK_T=SWIGLU_BLOCK[0],
                                                   BLOCK_N=SWIGLU_BLOCK[1], WIDEN=not y.is_cuda,
                                                   num_warps=SWIGLU_BLOCK[2])
    return dy


@torch.library.custom_op("turnrl::rotary_split", mutates_args=())
def _rotary_split_op(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                     kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rotary_split(y, cos, sin, heads, kv_heads)


@_rotary_split_op.register_fake
def _(y, cos, sin, heads, kv_heads):
    dim = y.shape[1] // (heads + 2 * kv_heads)
    t = y.shape[0]
    return y.new_empty((t, heads, dim)), y.new_empty((t, kv_heads, dim)), y.new_empty((t, kv_heads, dim))


@torch.library.custom_op("turnrl::rotary_merge", mutates_args=())
def _rotary_merge_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
    return rotary_merge(dq, dk, dv, cos, sin)


@_rotary_merge_op.register_fake
def _(dq, dk, dv, cos, sin):
    return dq.new_empty((dq.shape[0], (dq.shape[1] + 2 * dk.shape[1]) * dq.shape[2]))


def _rotary_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(inputs[1], inputs[2])


def _rotary_grad(ctx: Any, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> tuple:
    cos, sin = ctx.saved_tensors
    return _rotary_merge_op(dq, dk, dv, cos, sin), None, None, None, None


_rotary_split_op.register_autograd(_rotary_grad, setup_context=_rotary_setup)


@torch.library.custom_op("turnrl::swiglu", mutates_args=())
def _swiglu_op(y: torch.Tensor) -> torch.Tensor:
    return swiglu(y)


@_swiglu_op.register_fake
def _(y):
    return y.new_empty((y.shape[0], y.shape[1] // 2))


@torch.library.custom_op("turnrl::swiglu_back", mutates_args=())
def _swiglu_back_op(dh: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return swiglu_back(dh, y)


@_swiglu_back_op.register_fake
def _(dh, y):
    return y.new_empty((dh.shape[0], 2 * dh.shape[1]))


def _swiglu_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _swiglu_grad(ctx: Any, dh: torch.Tensor) -> torch.Tensor:
    return _swiglu_back_op(dh, ctx.saved_tensors[0])


_swiglu_op.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


def attention_fusable(attn: Any) -> bool:
    """Whether `attn` is a Llama-style attention this module can run: plain q/k/v/o nn.Linear (q, k, v all with
    biases or none), no per-head norms (Qwen3's q_norm) and no sliding window."""
    parts = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if not all(plain_linear(p, None) for p in parts) or not hasattr(attn, "head_dim") or not hasattr(attn, "scaling"):
        return False
    if len({p.bias is None for p in parts[:3]}) != 1 or hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        return False
    if getattr(attn, "sliding_window", None) or getattr(getattr(attn, "config", None), "layer_types", None) and \
            "sliding_attention" in attn.config.layer_types:
        return False
    dim = attn.head_dim
    q, k, v = (p.weight.shape[0] for p in parts[:3])
    return q % dim == 0 and k == v and k % dim == 0 and (q // dim) % (k // dim) == 0 and not dim & (dim - 1)


def _cat(layers: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([layer.weight for layer in layers])
    bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
    return weight, bias


def _fused_attention(self: Any, hidden_states: torch.Tensor, position_embeddings: Any = None,
                     attention_mask: Any = None, past_key_values: Any = None, **kwargs: Any) -> Any:
    parts = [self.q_proj, self.k_proj, self.v_proj]
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or past_key_values is not None or position_embeddings is None or hidden_states.shape[0] != 1 \
            or self.config._attn_implementation != f"{ATTENTION}_triton" \
            or not runs_fused(hidden_states, [p.weight for p in parts], _INTERPRET) \
            or (self.training and getattr(self, "attention_dropout", 0.0)):
        return self._turnrl_unfused_forward(hidden_states, position_embeddings, attention_mask, past_key_values,
                                            **kwargs)
    x = hidden_states[0]
    weight, bias = _cat(parts)
    y = torch.nn.functional.linear(x, weight, bias)
    cos, sin = (c.reshape(-1, c.shape[-1]).to(y.dtype).contiguous() for c in position_embeddings)
    dim = self.head_dim
    q, k, v = _rotary_split_op(y, cos, sin, parts[0].weight.shape[0] // dim, parts[1].weight.shape[0] // dim)
    out = flash_kernel.packed_attention(q, k, v, cu, int(kwargs["max_length_q"]), self.scaling)
    return self.o_proj(out.reshape(1, x.shape[0], -1)), None


def _fused_mlp(self: Any, x: torch.Tensor) -> torch.Tensor:
    parts = [self.gate_proj, self.up_proj]
    if not runs_fused(x, [p.weight for p in parts] + [self.down_proj.weight], _INTERPRET):
        return self._turnrl_unfused_forward(x)
    y = torch.nn.functional.linear(x, _cat(parts)[0])
    h = _swiglu_op(y.reshape(-1, y.shape[-1]))
    return self.down_proj(h.view(*x.shape[:-1], h.shape[-1]))


def projections_wanted(mode: str, device: torch.device, weights: torch.dtype, exact: bool, fused_mlp: bool) -> bool:
    """Whether `trainer.fused_projections` (`mode`) switches the local trainer's policy: `on` always (checks and
    `use_fused_projections` raise where it cannot), `off` never, `auto` on CUDA with 16-bit `weights` outside
    `engine.exact` (`exact`) and unless `trainer.fused_mlp` takes the MLPs: there the kernels run (on an H100,
    2026-12-08, the bench's update took 4.3 ms less; with the master AdamW step 7 ms, three passes alike)."""
    if mode != "auto":
        return mode == "on"
    return device.type == "cuda" and weights in (torch.bfloat16, torch.float16) and not exact and not fused_mlp


def use_fused_projections(model: Any, required: bool = True) -> dict[str, int]:
    """Switch `model`'s Llama-style attentions and SwiGLU MLPs to the fused projections (before torch.compile).
    Inputs they cannot take (CPU tensors, mixed dtypes, unpacked rows for the attention) still go through the
    modules' own forward. Returns how many of each were switched; a model with neither raises ValueError where
    the switch is `required` (`trainer.fused_projections: on`)."""
    counts = {"attention": 0, "mlp": 0}
    for module in model.modules():
        if attention_fusable(module):
            switch_forward(module, _fused_attention)
            counts["attention"] += 1
        elif plain_swiglu(module):
            switch_forward(module, _fused_mlp)
            counts["mlp"] += 1
    if required and not any(counts.values()):
        raise ValueError("trainer.fused_projections: the model has no Llama-style attention (plain q/k/v/o linears, "
                         "no per-head norms) and no plain SwiGLU MLP (LoRA-wrapped layers are not fused); set "
                         "trainer.fused_projections to auto or off")
    return counts
