"""The update's SwiGLU block on one GPU under torch.compile's modes: does max-autotune's Triton matmul with
fused epilogues beat cuBLAS plus inductor's pointwise kernels?

In a profile of `turnrl bench train` (H100, 2026-12-07) the SwiGLU's pointwise kernels (SiLU * up forward,
its backward) took 31 ms of a 302 ms update at ~3.1 TB/s, memory-bound, beside 185 ms of cuBLAS matmuls.
This probe times the block the decoder layer runs (RMSNorm, gate/up/down projections, SiLU * up, residual),
forward and backward, at the bench's token count (Qwen2.5-0.5B: hidden 896, intermediate 4864; bf16 weights,
bf16 activations), compiled with each mode in --modes, and lists the kernels of one step of each.

    PYTHONPATH=. python benchmarks/mlp_compile_probe.py --json OUT.json [--tokens 51456] [--modes default,...]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.norm = torch.nn.Parameter(torch.ones(hidden))
        self.gate = torch.nn.Linear(hidden, inner, bias=False)
        self.up = torch.nn.Linear(hidden, inner, bias=False)
        self.down = torch.nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.norm
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def timed(fn, x: torch.Tensor, grad: torch.Tensor, reps: int) -> float:
    for _ in range(3):
        fn(x).backward(grad)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(x).backward(grad)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def kernels(fn, x: torch.Tensor, grad: torch.Tensor) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(x).backward(grad)
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages() if e.device_time_total > 0]
    return [{"name": k[:140], "ms": round(ms, 3), "calls": c} for k, ms, c in sorted(rows, key=lambda r: -r[1])[:14]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=51456)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--inner", type=int, default=4864)
    ap.add_argument("--modes", default="default,max-autotune-no-cudagraphs")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    block = Block(args.hidden, args.inner).to(dev, torch.bfloat16)
    x = torch.randn(args.tokens, args.hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    flop = 6.0 * 3 * args.hidden * args.inner * args.tokens
    report = {"benchmark": "mlp_compile_probe", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "tokens": args.tokens, "hidden": args.hidden, "inner": args.inner, "matmul_tflop": flop / 1e12,
              "modes": {}}
    for mode in args.modes.split(","):
        torch._dynamo.reset()
        try:
            fn = block if mode == "eager" else torch.compile(block, mode=None if mode == "default" else mode,
                                                             dynamic=True)
            ms = timed(fn, x, grad, args.reps)
            entry = {"fwd_bwd_ms": round(ms, 3), "matmul_tflops": round(flop / ms / 1e9, 1),
                     "kernels": kernels(fn, x, grad)}
        except Exception as exc:  # a mode that fails here is a result too
            entry = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        report["modes"][mode] = entry
        print(mode, {k: v for k, v in entry.items() if k != "kernels"}, flush=True)
        for k in entry.get("kernels", []):
            print(f"    {k['ms']:8.3f} ms x{k['calls']:<3} {k['name'][:100]}", flush=True)
        x.grad = None
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
