"""The packed trainer's attention on one GPU against the other kernels torch has for it.

The trainer's update runs causal attention over packed rows with torch's varlen flash kernel (FA2, see
`turnrl/train/packing.py`); in a profile of `turnrl bench train` it was ~14% of the update's kernel time at
~120 TFLOP/s. This probe times one layer's attention, forward and backward, on the bench's rows (Qwen2.5-0.5B
heads: 14 query heads, 2 key/value heads, head size 64; 64 rows of 512-1024 tokens) through:
  varlen_fa2     the trainer's path (`packing._varlen`)
  varlen_cudnn   torch's varlen op on its cuDNN branch (key/value heads repeated: it takes no GQA)
  lanes_cudnn    SDPA's cuDNN kernel on rows sorted by length, in lanes of `--lane` rows padded to the lane's longest
  lanes_flash    the same lanes through SDPA's flash kernel
  padded_cudnn   SDPA's cuDNN kernel on all rows padded to the longest
  flex           FlexAttention (compiled) over the packed row with a block mask of the rows
  triton         turnrl's Triton kernels (`turnrl/train/flash_kernel.py`, trainer.packed_attention: triton) at
                 the module's blocking, `triton_atomic_dq` with its ATOMIC_DQ (FA2's one-kernel backward),
                 `triton_per_segment` with the grid segment after segment (SCHEDULE, the order before 2026-12-07),
                 `triton_per_head_keys` with the dK/dV kernel's per-head loops (FLAT_KEYS off, before 2026-12-07's
                 twelfth session), and `triton_<kernel>_<blocking>` for each blocking in --triton-forward,
                 --triton-keys, --triton-queries (program block:step block:warps:stages[:register cap]), the
                 others at default
Each variant's output on the real tokens is compared with varlen_fa2's, and the triton variants' gradients
with varlen_fa2's too (FA2's own run-to-run spread is reported beside them: its dQ is summed with atomics).
FLOPs are the causal ones actually needed (4 D H per query-key pair forward, 2.5x that backward), the same
count for every variant.

    PYTHONPATH=. python benchmarks/attention_backends_probe.py --json OUT.json [--variants varlen_fa2,triton]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from typing import Callable

import torch
import torch.nn.functional as F


def row_lengths(batch: int, seq_len: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(seq_len // 2, seq_len + 1, (batch,), generator=g)]


def timed(step: Callable[[], torch.Tensor], reps: int) -> tuple[float, float]:
    """(median forward ms, median forward + backward ms)."""
    grad = torch.randn_like(step())
    for _ in range(3):
        step().backward(grad)
    fwd, both = [], []
    for _ in range(reps):
        a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        a.record()
        out = step()
        b.record()
        out.backward(grad)
        c.record()
        torch.cuda.synchronize()
        fwd.append(a.elapsed_time(b))
        both.append(a.elapsed_time(c))
    return statistics.median(fwd), statistics.median(both)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--lane", type=int, default=8, help="rows per lane for the lanes_* variants")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default=None, help="comma-separated subset (default: all)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the variants this many times in turn (entries of later rounds: name#round)")
    ap.add_argument("--triton-forward", default="", help="forward blockings to sweep, e.g. 128:64:4:3,128:128:8:3")
    ap.add_argument("--triton-keys", default="", help="dK/dV kernel blockings to sweep")
    ap.add_argument("--triton-queries", default="", help="dQ kernel blockings to sweep")
    args = ap.parse_args()

    from turnrl.train import flash_kernel
    from turnrl.train.packing import _varlen, _varlen_params
    import torch.nn.attention.varlen as varlen_mod
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, dt = torch.device("cuda"), torch.bfloat16
    lengths = row_lengths(args.batch, args.seq_len, args.seed)
    n = sum(lengths)
    starts = [0] + [int(x) for x in torch.tensor(lengths).cumsum(0)]
    cu = torch.tensor(starts, dtype=torch.int32, device=dev)
    longest = max(lengths)
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    groups = hq // hkv
    torch.manual_seed(args.seed)
    q = torch.randn(n, hq, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(n, hkv, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(n, hkv, d, device=dev, dtype=dt, requires_grad=True)
    scale = d ** -0.5
    pairs = sum(x * (x + 1) // 2 for x in lengths)
    fwd_flop = 4.0 * d * hq * pairs
    report: dict = {"benchmark": "attention_backends_probe", "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "tokens": n,
                    "rows": len(lengths), "longest": longest, "heads": hq, "kv_heads": hkv, "head_dim": d,
                    "causal_fwd_tflop": fwd_flop / 1e12, "variants": {}}

    def rows_of(x: torch.Tensor, index: list[int], width: int) -> torch.Tensor:
        """[N, H, D] packed -> [len(index), H, width, D] right-padded rows."""
        out = x.new_zeros(len(index), x.shape[1], width, x.shape[2])
        for j, i in enumerate(index):
            out[j, :, :lengths[i]] = x[starts[i]:starts[i + 1]].transpose(0, 1)
        return out

    def back(o: torch.Tensor, index: list[int]) -> torch.Tensor:
        return torch.cat([o[j, :, :lengths[i]].transpose(0, 1) for j, i in enumerate(index)])

    def sdpa_lanes(backend: SDPBackend, lane: int) -> Callable[[], torch.Tensor]:
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        lanes = [order[s:s + lane] for s in range(0, len(order), lane)]
        perm = torch.tensor([i for group in lanes for i in group])
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(len(perm))
        # the packed token order of the lanes' outputs, back to the packed order of the rows
        spans = [torch.arange(starts[i], starts[i + 1]) for i in perm.tolist()]
        token_order = torch.cat(spans).to(dev)

        def step() -> torch.Tensor:
            outs = []
            with sdpa_kernel([backend]):
                for group in lanes:
                    width = max(lengths[i] for i in group)
                    qq = rows_of(q, group, width)
                    kk = rows_of(k, group, width).repeat_interleave(groups, 1)
                    vv = rows_of(v, group, width).repeat_interleave(groups, 1)
                    outs.append(back(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale),
                                     group))
            packed = torch.cat(outs)
            return torch.empty_like(packed).index_copy(0, token_order, packed)
        return step

    def varlen_cudnn() -> torch.Tensor:
        # run with varlen_mod._should_use_cudnn patched to True (forward and backward): see the loop below
        causal = {"window_size": (-1, 0)} if "window_size" in _varlen_params() else {"is_causal": True}
        return varlen_mod.varlen_attn(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                      cu, cu, longest, longest, scale=scale, **causal)

    def lanes_kernel(backend: SDPBackend, lane: int) -> Callable[[], torch.Tensor]:
        """The SDPA kernel alone: the lanes laid out beforehand (a trainer that keeps lanes end to end)."""
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        lanes = [order[s:s + lane] for s in range(0, len(order), lane)]
        with torch.no_grad():
            laid = [tuple(rows_of(x, group, max(lengths[i] for i in group)).requires_grad_()
                          for x in (q, k, v)) for group in lanes]

        def step() -> torch.Tensor:
            outs = []
            with sdpa_kernel([backend]):
                for qq, kk, vv in laid:
                    outs.append(F.scaled_dot_product_attention(qq, kk.repeat_interleave(groups, 1),
                                                               vv.repeat_interleave(groups, 1), is_causal=True,
                                                               scale=scale).flatten())
            return torch.cat(outs)
        return step

    def flex() -> Callable[[], torch.Tensor]:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        padded = (n + 127) // 128 * 128
        segment = torch.full((padded,), len(lengths), dtype=torch.int32, device=dev)
        for i in range(len(lengths)):
            segment[starts[i]:starts[i + 1]] = i

        def mask_mod(b, h, qi, ki):
            return (segment[qi] == segment[ki]) & (qi >= ki)
        block = create_block_mask(mask_mod, 1, 1, padded, padded, device=dev)
        compiled = torch.compile(flex_attention)

        def step() -> torch.Tensor:
            pad = padded - n
            qq = F.pad(q, (0, 0, 0, 0, 0, pad)).transpose(0, 1)[None]
            kk = F.pad(k, (0, 0, 0, 0, 0, pad)).transpose(0, 1)[None]
            vv = F.pad(v, (0, 0, 0, 0, 0, pad)).transpose(0, 1)[None]
            out = compiled(qq, kk, vv, block_mask=block, scale=scale, enable_gqa=True)
            return out[0].transpose(0, 1)[:n]
        return step

    defaults = flash_kernel.blocking()

    def triton_step(kernel: str | None, blocking: tuple[int, ...] | bool | None) -> Callable[[], torch.Tensor]:
        for name, value in defaults.items():
            setattr(flash_kernel, name, blocking if name == kernel else value)
        return lambda: flash_kernel.packed_attention(q, k, v, cu, longest, scale)

    def grads_of(step: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
        q.grad = k.grad = v.grad = None
        torch.manual_seed(args.seed + 1)
        step().backward(torch.randn(n, hq, d, device=dev, dtype=dt))
        out = [x.grad.float().clone() for x in (q, k, v)]
        q.grad = k.grad = v.grad = None
        return out

    variants: dict[str, Callable[[], Callable[[], torch.Tensor]]] = {
        "varlen_fa2": lambda: (lambda: _varlen(q, k, v, cu, longest, scale)),
        "varlen_cudnn": lambda: varlen_cudnn,
        "lanes_cudnn": lambda: sdpa_lanes(SDPBackend.CUDNN_ATTENTION, args.lane),
        "lanes_flash": lambda: sdpa_lanes(SDPBackend.FLASH_ATTENTION, args.lane),
        "lanes_cudnn_kernel_only": lambda: lanes_kernel(SDPBackend.CUDNN_ATTENTION, args.lane),
        "lanes_flash_kernel_only": lambda: lanes_kernel(SDPBackend.FLASH_ATTENTION, args.lane),
        "padded_cudnn": lambda: sdpa_lanes(SDPBackend.CUDNN_ATTENTION, len(lengths)),
        "flex": flex,
        "triton": lambda: triton_step(None, None),
        "triton_atomic_dq": lambda: triton_step("ATOMIC_DQ", True),
        "triton_per_segment": lambda: triton_step("SCHEDULE", "per_segment"),
        "triton_per_head_keys": lambda: triton_step("FLAT_KEYS", False),
    }
    for kernel, specs in (("forward", args.triton_forward), ("keys", args.triton_keys),
                          ("queries", args.triton_queries)):
        for spec in filter(None, specs.split(",")):
            blocking = tuple(int(x) for x in spec.split(":"))
            variants[f"triton_{kernel}_{spec}"] = functools.partial(triton_step, kernel.upper(), blocking)
    if args.variants:
        chosen = args.variants.split(",")
        variants = {name: make for name, make in variants.items() if name in chosen or
                    (name.startswith("triton_") and "triton" in chosen)}
    reference = None
    reference_grads = None
    original = getattr(varlen_mod, "_should_use_cudnn", None)
    rounds = [(name if r == 0 else f"{name}#{r + 1}", name, make) for r in range(args.rounds)
              for name, make in variants.items()]
    for label, name, make in rounds:
        if name == "varlen_cudnn" and original is not None:
            varlen_mod._should_use_cudnn = lambda index: True
        try:
            step = make()
            with torch.no_grad():
                out = step().float()
            if reference is None:
                reference = out
            f_ms, fb_ms = timed(step, args.reps)
            entry = {"fwd_ms": round(f_ms, 3), "fwd_bwd_ms": round(fb_ms, 3),
                     "fwd_tflops": round(fwd_flop / f_ms / 1e9, 1),
                     "fwd_bwd_tflops": round(3.5 * fwd_flop / fb_ms / 1e9, 1)}
            if out.shape == reference.shape:
                entry["max_abs_diff_vs_varlen_fa2"] = float((out - reference).abs().max())
            if name == "varlen_fa2" and reference_grads is None:
                reference_grads = grads_of(step)
                again = grads_of(step)
                entry["grad_max_abs_diff_run_to_run"] = [float((a - b).abs().max()) for a, b in
                                                         zip(again, reference_grads)]
            elif name.startswith("triton") and reference_grads is not None:
                entry["grad_max_abs_diff_vs_varlen_fa2"] = [float((a - b).abs().max()) for a, b in
                                                            zip(grads_of(step), reference_grads)]
                entry["grad_scale"] = [float(g.abs().max()) for g in reference_grads]
            if name.startswith("triton"):
                entry["blocking"] = flash_kernel.blocking()
        except Exception as exc:  # a backend torch lacks here is a result too
            entry = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        finally:
            if original is not None:
                varlen_mod._should_use_cudnn = original
            for key, value in defaults.items():
                setattr(flash_kernel, key, value)
        report["variants"][label] = entry
        print(label, entry, flush=True)
        q.grad = k.grad = v.grad = None
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
