"""GPU check: packed micro-batches (varlen flash attention) give the padded path's logprobs and gradients.

On a random-init Qwen2.5-0.5B-shaped model (bf16 autocast, fp32 weights), rows like `turnrl bench train`'s:
logprobs of the policy tokens, and the gradient of their masked sum, padded vs packed. Run on the device
machine from the repo root:
    PYTHONPATH=. python3 benchmarks/gpu_packing_check.py
Prints the torch varlen API it found and the differences; exits non-zero when they exceed bf16 noise.
"""

from __future__ import annotations

import copy
import inspect
import sys

import torch

from turnrl.bench.train import model_directory, synthetic_rows
from turnrl.train.packing import pack, use_packed_attention
from turnrl.train.policy import forward_logprobs, load_policy


def attention_check(device: torch.device) -> float:
    """`packed_attention` against SDPA run on each segment alone in float32: the worst relative error of the
    output and of the query/key/value gradients (GQA: 14 query heads on 2 key/value heads)."""
    from turnrl.train.packing import packed_attention
    torch.manual_seed(0)
    lengths = [700, 1024, 513, 96]
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(1, h, n, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for h in (14, 2, 2))
    g = torch.randn(1, n, 14, 64, device=device)
    out, _ = packed_attention(None, q, k, v, None, scaling=0.125, cu_seq_lens_q=cu, max_length_q=max(lengths))
    grads = torch.autograd.grad((out.float() * g).sum(), (q, k, v))
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    parts = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        parts.append(torch.nn.functional.scaled_dot_product_attention(
            qf[:, :, s:e], kf[:, :, s:e].repeat_interleave(7, 1), vf[:, :, s:e].repeat_interleave(7, 1),
            is_causal=True, scale=0.125))
    ref = torch.cat(parts, dim=2).transpose(1, 2)
    ref_grads = torch.autograd.grad((ref * g).sum(), (qf, kf, vf))
    errors = [float((a.float() - b).norm() / b.norm()) for a, b in zip((out, *grads), (ref, *ref_grads))]
    print("packed attention vs per-segment fp32 SDPA, relative error (out, dq, dk, dv):",
          " ".join(f"{e:.3g}" for e in errors), flush=True)
    return max(errors)


def main() -> int:
    from torch.nn.attention.varlen import varlen_attn
    print(torch.__version__, "varlen_attn", list(inspect.signature(varlen_attn).parameters), flush=True)
    device = torch.device("cuda")
    attention_error = attention_check(device)
    with model_directory("qwen2.5-0.5b-shape") as path:
        padded_model = load_policy(str(path), device)
    packed_model = copy.deepcopy(padded_model)
    use_packed_attention(packed_model)
    rows = synthetic_rows(8, 1024, 151936, device, seed=3, group=4)
    select = rows.loss_mask > 0
    results = []
    for model, packed in ((padded_model, None), (packed_model, pack(rows.lengths.cpu(), device))):
        model.zero_grad(set_to_none=True)
        lp, _ = forward_logprobs(model, rows.input_ids, rows.attention_mask, rows.position_ids,
                                 amp=torch.bfloat16, fused_head=True, select=select, packed=packed)
        (lp.float() * rows.loss_mask).sum().backward()
        grads = {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((lp.float().detach(), grads))
    (a, ga), (b, gb) = results
    lp_diff = float((a - b)[select].abs().max())
    lp_scale = float(a[select].abs().mean())
    rel = max(float((ga[k] - gb[k]).norm() / ga[k].norm().clamp(min=1e-12)) for k in ga)
    print(f"logprobs: max |padded - packed| {lp_diff:.4g} (mean |logprob| {lp_scale:.4g}); "
          f"worst relative gradient difference over {len(ga)} tensors {rel:.4g}", flush=True)
    return 0 if lp_diff < 0.05 * lp_scale and rel < 0.05 and attention_error < 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
