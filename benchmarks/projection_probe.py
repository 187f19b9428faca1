"""The fused projections (`turnrl/train/fused_projections.py`, `trainer.fused_projections`) against the compiled
separate ones on one GPU, at the train bench's shapes (Qwen2.5-0.5B: hidden 896, 14 query and 2 key/value heads of
64, intermediate 4864; 51,456 tokens, bf16):

- attention side: x -> (q, k, v) in the packed kernel's [tokens, heads, 64] layout, forward and backward (input
  and weight gradients): the three projections and transformers' rotary under torch.compile (as the trainer
  compiles the layer) against one GEMM and `rotary_split` / `rotary_merge`;
- MLP side: x -> h = silu(x Wg^T) * (x Wu^T), forward and backward: compiled against one GEMM and `swiglu` /
  `swiglu_back`;
- each of the four kernels alone, with the bytes it moves over its time, and the rotary kernels at the
  blockings of --rotary (tokens a program, warps, heads on the grid's first axis);
- the error of each side's outputs and gradients against float32 (max |difference| / max |reference|).

    PYTHONPATH=. python benchmarks/projection_probe.py --json OUT.json [--repeats 20]

CUDA events, the median of --repeats after warm-up. The unfused backward sums the parts' input gradients in the
compiled graph, as the layer's norm backward does.
"""

from __future__ import annotations

import argparse
import json

import torch

from turnrl.bench.common import event_ms, machine_info


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def separate_attention(x, wq, wk, wv, bq, bk, bv, cos, sin):
    """The three projections and transformers' rotary, to the packed kernel's [T, H, D] layout."""
    t = x.shape[0]
    q = torch.nn.functional.linear(x, wq, bq).view(1, t, -1, 64).transpose(1, 2)
    k = torch.nn.functional.linear(x, wk, bk).view(1, t, -1, 64).transpose(1, 2)
    v = torch.nn.functional.linear(x, wv, bv).view(1, t, -1, 64).transpose(1, 2)
    c, s = cos[None, None], sin[None, None]
    q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    return tuple(y[0].transpose(0, 1).contiguous() for y in (q, k, v))


def fused_attention(x, wq, wk, wv, bq, bk, bv, cos, sin):
    from turnrl.train.fused_projections import _rotary_split_op
    y = torch.nn.functional.linear(x, torch.cat([wq, wk, wv]), torch.cat([bq, bk, bv]))
    return _rotary_split_op(y, cos, sin, wq.shape[0] // 64, wk.shape[0] // 64)


def separate_mlp(x, wg, wu):
    return torch.nn.functional.silu(torch.nn.functional.linear(x, wg)) * torch.nn.functional.linear(x, wu)


def fused_mlp(x, wg, wu):
    from turnrl.train.fused_projections import _swiglu_op
    return _swiglu_op(torch.nn.functional.linear(x, torch.cat([wg, wu])))


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def side(name: str, fns: dict, leaves: list[torch.Tensor], constants: list[torch.Tensor], repeats: int) -> dict:
    """Forward-and-backward time of each of `fns` on `leaves` (+ `constants`), and its error against float32."""
    grads = None
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref = fns["separate"](*ref_leaves, *[c.float() for c in constants])
    ref = ref if isinstance(ref, tuple) else (ref,)
    g = torch.Generator(device="cuda").manual_seed(1)
    grads = [torch.randn(r.shape, device="cuda", generator=g) for r in ref]
    torch.autograd.backward(ref, grads)
    want = list(ref) + [t.grad for t in ref_leaves]
    out = {}
    for variant in ("separate", "fused"):
        fn = torch.compile(fns[variant], dynamic=True)

        def step():
            for t in leaves:
                t.grad = None
            y = fn(*leaves, *constants)
            y = y if isinstance(y, tuple) else (y,)
            torch.autograd.backward(y, [d.to(leaves[0].dtype) for d in grads])
            return list(y) + [t.grad for t in leaves]

        got = step()
        out[variant] = {"forward_backward_ms": event_ms(step, repeats),
                        "errors": [error(a, b) for a, b in zip(got, want)]}
    print(name, json.dumps(out))
    return out


def kernels(t: int, repeats: int) -> dict:
    """Each kernel alone: ms and GB/s (the bytes it must read and write)."""
    from turnrl.train import fused_projections as fp
    heads, kv, dim, inter = 14, 2, 64, 4864
    width = (heads + 2 * kv) * dim
    y = torch.randn(t, width, device="cuda", dtype=torch.bfloat16)
    cos, sin = (torch.rand(t, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q, k, v = fp.rotary_split(y, cos, sin, heads, kv)
    gu = torch.randn(t, 2 * inter, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(t, inter, device="cuda", dtype=torch.bfloat16)
    angles = 2 * t * dim * 2 * 2   # cos and sin, both halves read (one head's worth: the rest hit the L2)
    runs = {"rotary_split": (lambda: fp.rotary_split(y, cos, sin, heads, kv), 2 * y.numel() * 2 + angles),
            "rotary_merge": (lambda: fp.rotary_merge(q, k, v, cos, sin), 2 * y.numel() * 2 + angles),
            "swiglu": (lambda: fp.swiglu(gu), 3 * dh.numel() * 2),
            "swiglu_back": (lambda: fp.swiglu_back(dh, gu), 5 * dh.numel() * 2)}
    out = {}
    for name, (fn, nbytes) in runs.items():
        ms = event_ms(fn, repeats)
        out[name] = {"ms": ms, "gb_per_s": nbytes / ms / 1e6}
    print("kernels", json.dumps(out))
    return out


def rotary_blockings(t: int, blockings: list[tuple[int, int, bool]], repeats: int) -> dict:
    """rotary_split and rotary_merge at each (tokens, warps, heads first) of `fused_projections.ROTARY`: ms."""
    from turnrl.train import fused_projections as fp
    heads, kv, dim = 14, 2, 64
    y = torch.randn(t, (heads + 2 * kv) * dim, device="cuda", dtype=torch.bfloat16)
    cos, sin = (torch.rand(t, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    default, out = fp.ROTARY, {}
    try:
        for blocking in blockings:
            fp.ROTARY = blocking
            q, k, v = fp.rotary_split(y, cos, sin, heads, kv)
            out[":".join(str(int(x)) for x in blocking)] = {
                "split_ms": event_ms(lambda: fp.rotary_split(y, cos, sin, heads, kv), repeats),
                "merge_ms": event_ms(lambda: fp.rotary_merge(q, k, v, cos, sin), repeats)}
    finally:
        fp.ROTARY = default
    print("rotary", json.dumps(out))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=51456)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--kernels-only", action="store_true", help="time the kernels alone, not the two sides")
    p.add_argument("--rotary", default="64:4:0,64:4:1,128:4:1,128:8:1,32:4:1,256:8:1",
                   help="blockings of the rotary kernels to time: tokens:warps:heads-first, comma-separated")
    args = p.parse_args()
    torch.manual_seed(0)
    t, hidden, inter = args.tokens, 896, 4864
    blockings = [tuple(int(x) for x in b.split(":")) for b in args.rotary.split(",")]
    bf = dict(device="cuda", dtype=torch.bfloat16)

    def weight(n, k):
        return (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16).requires_grad_()

    x = torch.randn(t, hidden, **bf).requires_grad_()
    inv = 1.0 / (1e6 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    freqs = (torch.arange(t, device="cuda") % 1024).float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    report = {"benchmark": "projection_probe", "tokens": t}
    if not args.kernels_only:
        report["attention"] = side("attention", {"separate": separate_attention, "fused": fused_attention},
                                   [x, weight(896, hidden), weight(128, hidden), weight(128, hidden),
                                    *(torch.randn(n, **bf).requires_grad_() for n in (896, 128, 128))], [cos, sin],
                                   args.repeats)
        report["mlp"] = side("mlp", {"separate": separate_mlp, "fused": fused_mlp},
                             [x, weight(inter, hidden), weight(inter, hidden)], [], args.repeats)
    report.update(kernels=kernels(t, args.repeats), rotary_blockings=rotary_blockings(t, blockings, args.repeats),
                  machine=machine_info())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
