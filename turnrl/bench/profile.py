"""Where an update's device time goes: kernels grouped by kind, from one `torch.profiler` run.

`profile_call(fn, device)` runs `fn` once under the profiler and returns a breakdown: device time per
category (matmul, attention, fused/elementwise, optimizer, head, copies, other), the top kernels, and the busy
fraction of the wall time (what the device computed against how long the call took: the rest is launch
gaps and host work). On a CPU the "kernels" are the profiler's CPU ops, self time (no double counting of
nested ops), so the same table is useful there too.
"""

from __future__ import annotations

import contextlib
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch.autograd import DeviceType

# First match wins. Names are CUDA kernel names (cuBLAS/CUTLASS, flash-attention, Triton from inductor,
# PyTorch's own) or, on a CPU, aten op names.
CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("optimizer", re.compile(r"adam|multi_tensor_apply|_foreach_|fused_adam", re.I)),
    ("head", re.compile(r"^head_logit_")),   # the fused head's passes over the logits (turnrl/train/head_kernel.py)
    ("attention", re.compile(r"flash|fmha|attention|sdpa|_efficient_attention", re.I)),
    ("attention", re.compile(r"^(forward|keys|queries)$")),   # turnrl's Triton attention (turnrl/train/flash_triton.py)
    ("swiglu", re.compile(r"^(gate_up|down_back)$")),   # the fused MLP's GEMMs (turnrl/train/swiglu_triton.py)
    # the fused projections' passes (turnrl/train/projection_triton.py)
    ("fused_elementwise", re.compile(r"^(rotary_split|rotary_merge|swiglu|swiglu_back)$")),
    ("matmul", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|sm90_|sm80_|cublas|aten::(mm|addmm|bmm|matmul|linear)\b",
                          re.I)),
    # inductor's kernels: reductions (persistent or looped) and pointwise ones, casts fused in or not
    ("reduction", re.compile(r"^triton_(red|per)_")),
    ("fused_elementwise", re.compile(r"^triton_")),
    ("copy", re.compile(r"memcpy|memset|copy_|aten::(to|_to_copy|copy_|clone|contiguous)\b", re.I)),
    ("reduction", re.compile(r"reduce|norm|softmax|logsumexp|sum|amax|max_", re.I)),
    ("fused_elementwise", re.compile(r"elementwise|vectorized|unrolled|aten::(add|mul|sub|div|exp|silu|"
                                     r"neg|where|cat|index|gather|scatter)", re.I)),
)


@dataclass(frozen=True)
class Kernel:
    name: str
    calls: int
    seconds: float


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


def breakdown(kernels: Iterable[Kernel], wall_s: float, top: int = 25) -> dict[str, Any]:
    """Device seconds per category and the `top` kernels by time; `busy_fraction` = kernel time / wall."""
    kernels = sorted(kernels, key=lambda k: k.seconds, reverse=True)
    total = sum(k.seconds for k in kernels)
    sums: dict[str, float] = {}
    for k in kernels:
        sums[category(k.name)] = sums.get(category(k.name), 0.0) + k.seconds
    by_category = dict(sorted(sums.items(), key=lambda kv: -kv[1]))
    return {"wall_s": wall_s, "kernel_s": total, "busy_fraction": total / wall_s if wall_s > 0 else None,
            "by_category_s": by_category,
            "by_category_fraction": {c: s / total for c, s in by_category.items()} if total > 0 else {},
            "top": [{"name": k.name[:160], "category": category(k.name), "calls": k.calls, "s": k.seconds,
                     "fraction": k.seconds / total if total else None} for k in kernels[:top]]}


def _kernels(prof: Any, device: torch.device) -> list[Kernel]:
    """Device-side rows on CUDA (kernels, copies; not the CPU ops that launched them again, nor the GPU-side
    ranges of user annotations), CPU ops' self time elsewhere."""
    out = []
    for e in prof.key_averages():
        if device.type == "cuda" and (getattr(e, "device_type", None) != DeviceType.CUDA
                                      or getattr(e, "is_user_annotation", False)):
            continue   # a GPU-side range (`Optimizer.step#AdamW.step`) spans kernels that are counted themselves
        seconds = (getattr(e, "self_device_time_total", 0.0) if device.type == "cuda" else e.self_cpu_time_total) / 1e6
        if seconds > 0:
            out.append(Kernel(e.key, int(e.count), float(seconds)))
    return out


def idle_gaps(spans: Iterable[tuple[float, float, str]], top: int = 8) -> dict[str, Any]:
    """Where the device waited: spans are (start, end, name) of its kernels (any time unit; seconds out if the
    spans are in microseconds). Returns the idle time between the first kernel's start and the last one's end,
    the launch count, and the `top` longest gaps with the kernels either side (a gap after a kernel that ends a
    phase, the host catching up after a sync, usually names the place)."""
    spans = sorted(spans)
    if not spans:
        return {"launches": 0, "span_s": 0.0, "idle_s": 0.0, "gaps": []}
    gaps: list[tuple[float, str, str]] = []
    covered, last = spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > covered:
            gaps.append((start - covered, last, name))
        if end > covered:
            covered, last = end, name
    gaps.sort(key=lambda g: -g[0])
    return {"launches": len(spans), "span_s": (covered - spans[0][0]) / 1e6,
            "idle_s": sum(g[0] for g in gaps) / 1e6,
            "gaps": [{"ms": g / 1e3, "before": before[:100], "after": after[:100]} for g, before, after in gaps[:top]]}


def launch_delays(pairs: Iterable[tuple[float, float]]) -> dict[str, Any]:
    """How long each kernel waited between its launch on the host and its start on the device (pairs of
    (launch start, kernel start), microseconds): a device that is the bottleneck holds a queue of launched
    work (delays of milliseconds); a host that is, launches each kernel just before the device runs dry
    (delays of microseconds, `starved` near 1)."""
    delays = sorted(max(0.0, k - h) for h, k in pairs)
    if not delays:
        return {"kernels": 0}
    q = lambda f: delays[min(len(delays) - 1, int(f * len(delays)))] / 1e3   # noqa: E731  (ms)
    return {"kernels": len(delays), "p10_ms": q(0.1), "median_ms": q(0.5), "p90_ms": q(0.9),
            "starved": sum(d < 50.0 for d in delays) / len(delays)}


CALL = "turnrl.profiled_call"   # the annotation around the profiled call: its range on the profiler's clock


def host_edges(call: tuple[float, float], spans: Iterable[tuple[float, float, str]],
               host_ops: Iterable[tuple[float, float, str]], top: int = 8) -> dict[str, Any]:
    """The device's idle time at the ends of a call (microseconds in, milliseconds out): from the call's start
    to its first kernel (the host preparing the work and launching the first kernel), and from its last
    kernel's end to the call's end (reading the results back, returning). `host_ops` (start, end, name) are
    the host's ops; those that end before the first kernel starts are summed by name, the longest `top` kept."""
    spans = sorted(spans)
    if not spans:
        return {"to_first_kernel_ms": None, "after_last_kernel_ms": None, "before_first_kernel": []}
    first = spans[0][0]
    last = max(end for _, end, _ in spans)
    before: dict[str, float] = {}
    for start, end, name in host_ops:
        if start >= call[0] and end <= first:
            before[name] = before.get(name, 0.0) + (end - start)
    ranked = sorted(before.items(), key=lambda kv: -kv[1])[:top]
    return {"to_first_kernel_ms": max(0.0, first - call[0]) / 1e3,
            "after_last_kernel_ms": max(0.0, call[1] - last) / 1e3,
            "before_first_kernel": [{"name": name[:100], "ms": us / 1e3} for name, us in ranked]}


def _call_range(prof: Any) -> tuple[float, float] | None:
    for e in prof.events():
        if e.name == CALL and getattr(e, "device_type", None) == DeviceType.CPU:
            return e.time_range.start, e.time_range.end
    return None


def _host_ops(prof: Any) -> list[tuple[float, float, str]]:
    """The host's outermost ops inside the call (aten calls, CUDA runtime calls; nested ones are inside them)."""
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if getattr(e, "device_type", None) == DeviceType.CPU and e.name != CALL
            and (e.cpu_parent is None or e.cpu_parent.name == CALL)]


def _launch_pairs(prof: Any) -> list[tuple[float, float]]:
    """(launch start, kernel start) of each device event, matched by CUPTI correlation id to the runtime call
    (cudaLaunchKernel, cuLaunchKernel, cudaMemcpyAsync, ...) on the host."""
    launches = {e.id: e.time_range.start for e in prof.events()
                if getattr(e, "device_type", None) == DeviceType.CPU and e.name.startswith("cu")}
    return [(launches[e.id], e.time_range.start) for e in prof.events()
            if getattr(e, "device_type", None) == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
            and e.id in launches]


def _device_spans(prof: Any) -> list[tuple[float, float, str]]:
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if getattr(e, "device_type", None) == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def profile_call(fn: Callable[[], Any], device: torch.device, top: int = 25) -> dict[str, Any]:
    """Run `fn` once under the profiler (after the caller's warm-up) and return `breakdown` of its kernels."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        with record_function(CALL) if device.type == "cuda" else contextlib.nullcontext():
            fn()
            sync()
        wall = time.perf_counter() - start
    report = breakdown(_kernels(prof, device), wall, top)
    if device.type == "cuda":
        spans = _device_spans(prof)
        report["idle"] = idle_gaps(spans)
        report["launch_delay"] = launch_delays(_launch_pairs(prof))
        call = _call_range(prof)
        if call is not None:
            report["edges"] = host_edges(call, spans, _host_ops(prof))
    return report


def host_syncs(fn: Callable[[], Any], device: torch.device) -> list[str]:
    """Where `fn` makes the host wait for the device ('file:line' of each call that synchronizes: a copy to
    the host, `.item()`, a boolean index), from CUDA's sync debug mode; [] off CUDA, where nothing waits."""
    if device.type != "cuda":
        return []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # each wait warns ("called a synchronizing CUDA operation"); switching the mode on warns that it is a
    # prototype ("... does not yet detect all synchronizing operations"): that one is no wait
    return [f"{Path(w.filename).name}:{w.lineno}" for w in seen
            if "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message)]


def format_breakdown(report: dict[str, Any], title: str) -> str:
    lines = [f"{title}: wall {report['wall_s'] * 1e3:.1f} ms, kernels {report['kernel_s'] * 1e3:.1f} ms"
             + (f" (busy {report['busy_fraction']:.1%})" if report["busy_fraction"] is not None else "")]
    lines += [f"  {c:<18} {s * 1e3:8.1f} ms  {report['by_category_fraction'].get(c, 0):6.1%}"
              for c, s in report["by_category_s"].items()]
    lines += [f"    {k['s'] * 1e3:8.2f} ms x{k['calls']:<5} {k['category']:<17} {k['name'][:90]}" for k in report["top"][:12]]
    delay = report.get("launch_delay")
    if delay and delay.get("kernels"):
        lines.append(f"  launch to start: median {delay['median_ms']:.3f} ms (p10 {delay['p10_ms']:.3f}, p90 "
                     f"{delay['p90_ms']:.3f}); {delay['starved']:.0%} of {delay['kernels']} kernels started within "
                     f"50 us of their launch (the host was the bottleneck there)")
    idle = report.get("idle")
    if idle:
        lines.append(f"  device idle {idle['idle_s'] * 1e3:.1f} ms between {idle['launches']} launches over "
                     f"{idle['span_s'] * 1e3:.1f} ms; longest gaps:")
        lines += [f"    {g['ms']:8.2f} ms after {g['before'][:50]} before {g['after'][:50]}" for g in idle["gaps"][:5]]
    edges = report.get("edges")
    if edges and edges["to_first_kernel_ms"] is not None:
        lines.append(f"  device idle at the ends: {edges['to_first_kernel_ms']:.2f} ms from the call to its first "
                     f"kernel, {edges['after_last_kernel_ms']:.2f} ms after its last; host ops before the first:")
        lines += [f"    {op['ms']:8.2f} ms {op['name'][:90]}" for op in edges["before_first_kernel"][:5]]
    return "\n".join(lines)
