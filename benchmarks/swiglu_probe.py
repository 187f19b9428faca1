"""The fused SwiGLU MLP (`turnrl/train/swiglu_kernel.py`, `trainer.fused_mlp`) against the compiled unfused MLP on
one GPU, at the train bench's shapes (Qwen2.5-0.5B: hidden 896, intermediate 4864; 51,412 tokens, bf16):

- each fused kernel alone against what it replaces: `gate_up` against the gate and up GEMMs (cuBLAS) plus the
  compiled SiLU-and-product pass; `down_back` against the down projection's input-gradient GEMM plus the
  compiled SiLU backward;
- the whole MLP, forward and backward, both under torch.compile (the unfused one as the trainer compiles it);
- the error of each against a float32 reference (max |difference| / max |reference|), output and gradients.

    PYTHONPATH=. python benchmarks/swiglu_probe.py --json OUT.json [--gate-up 128:64:64:8:4,...] [--down-back ...]
    python benchmarks/swiglu_probe.py --best OUT.json -- bench train ...   # sets the fastest, runs turnrl

Blockings: rows:columns:depth:warps:stages[:tma] (as `swiglu_kernel.GATE_UP`, `DOWN_BACK`; tma 1: the kernels that
move tiles with tensor descriptors). CUDA events, the median
of --repeats after warm-up.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys

import torch

from turnrl.bench.common import event_ms as timed


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def blockings(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in item.split(":")) for item in text.split(",") if item]


def unfused(x, wg, wu, wd):
    return torch.nn.functional.linear(torch.nn.functional.silu(x @ wg.t()) * (x @ wu.t()), wd)


def probe(args: argparse.Namespace) -> dict:
    from turnrl.train import swiglu_kernel as sk

    torch.manual_seed(0)
    m, k, n = args.tokens, args.hidden, args.intermediate
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = (torch.randn(m, k, device=dev)).to(dt)
    wg, wu = ((torch.randn(n, k, device=dev) / k ** 0.5).to(dt) for _ in range(2))
    wd = (torch.randn(k, n, device=dev) / n ** 0.5).to(dt)
    dy = torch.randn(m, k, device=dev).to(dt) * 1e-2
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]

    def grads(fn, tensors):
        for t in tensors:
            t.grad = None
        y = fn(*tensors)
        y.backward(dy.to(y.dtype))
        return [y.detach()] + [t.grad for t in tensors]

    reference = grads(unfused, [t.detach().float().requires_grad_() for t in leaves])
    compiled = torch.compile(unfused, dynamic=True)
    report: dict = {"shape": {"tokens": m, "hidden": k, "intermediate": n}, "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "repeats": args.repeats}

    # what the fused kernels replace, piece by piece
    act = torch.compile(lambda g, u: torch.nn.functional.silu(g) * u, dynamic=True)
    g, u = x @ wg.t(), x @ wu.t()
    gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()
    h = act(gr, ur)
    dh = dy @ wd

    def act_back():
        torch.autograd.grad(h, (gr, ur), dh, retain_graph=True)

    report["unfused"] = {
        "gate_up_gemms_ms": timed(lambda: (x @ wg.t(), x @ wu.t()), args.repeats),
        "silu_mul_ms": timed(lambda: act(g, u), args.repeats),
        "down_input_grad_gemm_ms": timed(lambda: dy @ wd, args.repeats),
        "silu_mul_backward_ms": timed(act_back, args.repeats),
        "mlp_forward_backward_ms": timed(lambda: grads(compiled, leaves), args.repeats),
        "errors": [error(a, b) for a, b in zip(grads(compiled, leaves), reference)],
    }

    def kernel(name: str, blocking: tuple[int, ...], run) -> dict:
        setattr(sk, name, blocking)
        try:
            return {"ms": timed(run, args.repeats)}
        except Exception as exc:  # noqa: BLE001 - a blocking that does not build (shared memory) is a result
            return {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}

    default = sk.GATE_UP, sk.DOWN_BACK
    report["gate_up"] = {":".join(map(str, b)): kernel("GATE_UP", b, lambda: sk.gate_up(x, wg, wu))
                         for b in blockings(args.gate_up)}
    report["down_back"] = {":".join(map(str, b)): kernel("DOWN_BACK", b, lambda: sk.down_back(dy, wd, g, u))
                           for b in blockings(args.down_back)}
    fused = torch.compile(sk.swiglu, dynamic=True)   # the custom ops read the blocking when they run
    report["fused"] = {}
    for label, pair in (("default", default), ("fastest", best(report))):
        sk.GATE_UP, sk.DOWN_BACK = pair
        report["fused"][label] = {"blocking": pair, "mlp_forward_backward_ms": timed(lambda: grads(fused, leaves),
                                                                                      args.repeats),
                                  "errors": [error(a, b) for a, b in zip(grads(fused, leaves), reference)]}
    sk.GATE_UP, sk.DOWN_BACK = default
    for part in ("gate_up", "down_back", "fused"):
        print(part, json.dumps(report[part]), flush=True)
    print("unfused", json.dumps(report["unfused"]), flush=True)
    return report


def best(report: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The fastest blockings (GATE_UP, DOWN_BACK) of a probe's report."""
    def fastest(entries: dict) -> tuple[int, ...]:
        name = min((e["ms"], name) for name, e in entries.items() if "ms" in e)[1]
        return tuple(int(v) for v in name.split(":"))
    return fastest(report["gate_up"]), fastest(report["down_back"])


def main() -> None:
    argv = sys.argv[1:]
    if argv and argv[0] == "--best":
        with open(argv[1]) as fh:
            gate_up, down_back = best(json.load(fh))
        print("blocking:", json.dumps({"GATE_UP": gate_up, "DOWN_BACK": down_back}), flush=True)
        if "--" in argv:
            from turnrl.train import swiglu_kernel
            swiglu_kernel.GATE_UP, swiglu_kernel.DOWN_BACK = gate_up, down_back
            sys.argv = ["turnrl", *argv[argv.index("--") + 1:]]
            runpy.run_module("turnrl", run_name="__main__")
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=51412)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--gate-up", default="128:64:64:8:3,128:64:64:8:4,128:128:64:8:3,128:64:64:8:3:1,128:64:64:8:4:1,"
                                        "128:128:64:8:3:1")
    p.add_argument("--down-back", default="128:64:64:8:3,128:128:64:8:4,64:128:64:4:3,128:64:64:8:3:1,128:128:64:8:3:1,"
                                          "128:128:64:8:4:1")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    report = probe(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
