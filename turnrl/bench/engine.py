"""Decode throughput of the embedded engines against plain `model.generate`, one workload, one run.

Workload: `batch` prompts of `prompt` random tokens, each generating exactly `new` tokens (temperature 1, no
top-k/top-p, no stop token), on one model (a shape model of turnrl.bench.train.SHAPES: random init from a
config dict, no download; or any model spec). Variants, each timed after a warm-up on the same model object:

- `generate`: transformers `model.generate(do_sample=True, min_new_tokens=new)` on the padded batch;
- `hf`: the existing HFEngine (turnrl/engines/hf.py), all requests submitted at once;
- `fast`: the FastEngine (turnrl/engines/fast) with CUDA graphs, eager kernels;
- `fast-compile`: the same with torch.compile on the layers' pure pieces and the Triton sampling kernels
  (`engines/fast/sample_kernel.py`): the engine's default on CUDA;
- `fast-torch-sampling`: `fast-compile` with the torch sampler instead of the kernels (what they save);
- `fast-torch-rope`: `fast-compile` with the rotary embedding in its own compiled kernel instead of inside the
  cache-write and attention kernels (what that saves);
- `fast-exact`: the fast engine with engine.exact (batch-invariant forward of turnrl/exact, CUDA graphs, eager).
The warm-up is the same request set (the fast engines: the whole run once, so that every batch and cache
bucket of the timed run has its graph; the HF engine: 8 new tokens); graph capture and compilation stay out
of the timing, their cost is reported as `warmup_s`.

tok/s = batch * new / wall time (prefill included); ms/step = wall / new. For the fast engines the decode
step alone (graph replay at the full batch and the run's final cache bucket) is also timed, split into the
layers and the head + sampling. The bound: a decode step must read every weight once and each sequence's
cached keys/values (mean context prompt + new/2), so bytes/step / bandwidth (measured device-to-device copy
bandwidth, and the nominal 4.8 TB/s of an H200) -> ms/step -> tok/s = batch / that; the matmul FLOPs over
the measured bf16 peak give the compute floor.
"""

from __future__ import annotations

import asyncio
import gc
import time
import traceback
from typing import Any, Callable

import torch

from turnrl.bench.common import graph_ms, machine_info
from turnrl.engines.base import Sampling
from turnrl.engines.hf import resolve_device

VARIANTS = ("generate", "hf", "fast", "fast-compile", "fast-torch-sampling", "fast-torch-rope", "fast-exact")
NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}       # bytes/s, vendor datasheets
PEAK_FLOPS = {"H200": 790e12, "H100": 790e12}                # bf16 dense matmul measured on the lent H200


def build_model(spec: str, device: torch.device, dtype: torch.dtype) -> Any:
    """A shape model (random init, seed 0) built on the device, or a prepared/local model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from turnrl.bench.train import SHAPES
    from turnrl.models import resolve

    if spec in SHAPES:
        config = AutoConfig.for_model(**SHAPES[spec])
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(resolve(spec)), dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


def bench_engine(spec: str, batch: int, prompt: int, new: int, variants: list[str], device: str = "auto",
                 dtype: str = "bfloat16", seed: int = 0, on_variant: Callable[[dict], None] | None = None
                 ) -> dict[str, Any]:
    if batch < 1 or prompt < 1 or new < 2:
        raise ValueError("the engine benchmark needs batch >= 1, prompt >= 1 and new >= 2")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    dev = resolve_device(device)
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    t0 = time.perf_counter()
    model = build_model(spec, dev, torch_dtype)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(min(100, vocab // 4), vocab - min(100, vocab // 4), (batch, prompt), generator=g).tolist()
    report: dict[str, Any] = {
        "benchmark": "engine", "model": spec, "batch": batch, "prompt": prompt, "new": new, "dtype": dtype,
        "device": str(dev), "model_build_s": time.perf_counter() - t0, "variants": {},
        "bound": bound(model, batch, prompt, new, dev), "machine": machine_info()}
    runners = {"generate": _generate, "hf": _hf_engine, "fast": lambda *a: _fast_engine(*a, compile=False),
               "fast-compile": lambda *a: _fast_engine(*a, compile=True),
               "fast-torch-sampling": lambda *a: _fast_engine(*a, compile=True, fused_sampling=False),
               "fast-torch-rope": lambda *a: _fast_engine(*a, compile=True, fused_rope=False),
               "fast-exact": lambda *a: _fast_engine(*a, compile=False, exact=True)}
    for name in variants:
        start = time.perf_counter()
        try:
            result = runners[name](model, prompts, new, dev, seed)
            result["tokens_per_s"] = batch * new / result["seconds"]
            result["ms_per_step"] = result["seconds"] / new * 1000
        except Exception as exc:  # noqa: BLE001 - report it, go on with the other variants
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        result["variant_s"] = time.perf_counter() - start
        report["variants"][name] = result
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        _summarize(report)
        if on_variant is not None:
            on_variant(report)
    return report


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _generate(model: Any, prompts: list[list[int]], new: int, dev: torch.device, seed: int) -> dict[str, Any]:
    ids = torch.tensor(prompts, device=dev)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    warm = time.perf_counter()
    model.generate(ids[:8], attention_mask=torch.ones_like(ids[:8]), max_new_tokens=8, **kwargs)
    _sync(dev)
    warm = time.perf_counter() - warm
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, **kwargs)
    _sync(dev)
    seconds = time.perf_counter() - start
    generated = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"seconds": seconds, "warmup_s": warm, "generated_tokens": generated}


async def _submit(engine: Any, prompts: list[list[int]], new: int, seed: int) -> list[Any]:
    return await asyncio.gather(*(engine.generate(p, Sampling(max_tokens=new, temperature=1.0, seed=seed + i))
                                  for i, p in enumerate(prompts)))


def _run_engine(engine: Any, prompts: list[list[int]], new: int, dev: torch.device, seed: int,
                warm_new: int) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        try:
            warm = time.perf_counter()
            await _submit(engine, prompts, warm_new, seed)
            warm = time.perf_counter() - warm
            before = dict(engine.stats)
            start = time.perf_counter()
            outs = await _submit(engine, prompts, new, seed)
            _sync(dev)
            seconds = time.perf_counter() - start
            stats = {k: v - before.get(k, 0) for k, v in engine.stats.items() if isinstance(v, (int, float))}
            result = {"seconds": seconds, "warmup_s": warm, "generated_tokens": sum(len(o.token_ids) for o in outs),
                      "finish_reasons": sorted({o.finish_reason for o in outs}), "engine_stats": stats}
            profile = getattr(engine, "decoder", None) is not None and dev.type == "cuda"
            if profile:
                result["step"] = profile_step(engine, len(prompts), len(prompts[0]) + new)
                result["notes"] = list(engine.notes)
            return result
        finally:
            await engine.close()
    return asyncio.run(run())


def _hf_engine(model: Any, prompts: list[list[int]], new: int, dev: torch.device, seed: int) -> dict[str, Any]:
    from turnrl.engines.hf import HFEngine

    engine = HFEngine("", device=str(dev), dtype=_dtype_name(model), max_batch_size=len(prompts), model=model)
    return _run_engine(engine, prompts, new, dev, seed, warm_new=min(new, 8))


def _fast_engine(model: Any, prompts: list[list[int]], new: int, dev: torch.device, seed: int,
                 compile: bool, exact: bool = False, fused_sampling: bool | None = None,
                 fused_rope: bool | None = None) -> dict[str, Any]:
    from turnrl.engines.fast import FastEngine

    max_len = -(-(len(prompts[0]) + new) // 128) * 128
    engine = FastEngine("", device=str(dev), dtype=_dtype_name(model), max_batch_size=len(prompts), max_len=max_len,
                        model=model, compile=compile and dev.type == "cuda", cuda_graphs=dev.type == "cuda",
                        exact=exact, fused_sampling=fused_sampling, fused_rope=fused_rope)
    try:
        return _run_engine(engine, prompts, new, dev, seed, warm_new=new)
    finally:
        del engine


def _dtype_name(model: Any) -> str:
    return {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[model.dtype]


def profile_step(engine: Any, batch: int, length: int, repeats: int = 50) -> dict[str, float]:
    """Median ms of the decode step at `batch` slots over `length` cache positions, and of its two halves
    (layers; head + sampling + bookkeeping), each captured as its own CUDA graph on the idle engine (every slot
    is free after the run: the step computes the same, its writes land in free slots)."""
    from turnrl.engines.fast.step import KV_BUCKET

    n_kv = min(engine.max_len, -(-length // KV_BUCKET) * KV_BUCKET)
    s = engine.state
    hidden = {}

    def layers() -> None:
        hidden["x"] = engine.step.forward(batch, n_kv)

    def finish() -> None:
        engine.step.units["finish"](hidden["x"], s.temperature[:batch], s.key[:batch], s.count[:batch],
                                    s.top_k[:batch], s.top_p[:batch], s.active[:batch], s.stop[:batch],
                                    s.max_tokens[:batch], s.last[:batch], s.pos[:batch], False, False)

    def step() -> None:
        engine.step.run(batch, n_kv, False, False)
    out = {"batch": batch, "n_kv": n_kv}
    for name, fn in (("layers", layers), ("head_sample", finish), ("step", step)):
        out[f"{name}_ms"] = graph_ms(fn, repeats, stream=engine.step.stream)
    with torch.cuda.stream(engine.step.stream):
        out["top_kernels"] = _top_kernels(step)
    return out


def _top_kernels(fn: Callable[[], None], top: int = 12) -> list[tuple[str, float, int]]:
    """(kernel, total ms, calls) of one uncaptured run of `fn`, largest first: where a step's time goes."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        rows = [(e.key[:90], e.device_time_total / 1000, e.count) for e in prof.key_averages()
                if e.device_time_total > 0]
        return sorted(rows, key=lambda r: -r[1])[:top]
    except Exception as exc:  # noqa: BLE001 - a missing profiler costs only this table
        return [(f"profiler failed: {type(exc).__name__}: {exc}"[:200], 0.0, 0)]


def copy_bandwidth(dev: torch.device, gib: float = 1.0) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of 10."""
    if dev.type != "cuda":
        return None
    src = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1000)
    return 2 * src.numel() * src.element_size() / sorted(times)[5]


def bound(model: Any, batch: int, prompt: int, new: int, dev: torch.device) -> dict[str, Any]:
    """What one decode step must move and compute, and the throughput that allows."""
    c = model.config
    params = {id(p): p for p in model.parameters()}.values()            # tied weights once
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    elem = next(iter(params)).element_size()
    kv_per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * elem
    context = prompt + new / 2                                          # mean cached length over the run
    kv_bytes = batch * context * kv_per_token
    embedding = model.get_input_embeddings().weight.numel()
    matmul_params = sum(p.numel() for p in params) - embedding + model.get_output_embeddings().weight.numel()
    flops = 2 * matmul_params * batch + 4 * batch * context * c.num_hidden_layers * c.num_attention_heads * head_dim
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else ""
    nominal = next((bw for key, bw in NOMINAL_BANDWIDTH.items() if key in name), None)
    peak = next((f for key, f in PEAK_FLOPS.items() if key in name), None)
    measured = copy_bandwidth(dev)
    out: dict[str, Any] = {"weight_bytes": weight_bytes, "kv_bytes_per_step": kv_bytes,
                           "kv_bytes_per_token": kv_per_token, "logits_bytes_per_step": batch * c.vocab_size * elem, "flops_per_step": flops,
                           "copy_bandwidth": measured, "nominal_bandwidth": nominal, "peak_flops": peak}
    for label, bw in (("measured", measured), ("nominal", nominal)):
        if bw:
            ms = (weight_bytes + kv_bytes) / bw * 1000
            out[f"memory_ms_per_step_{label}"] = ms
            out[f"tokens_per_s_bound_{label}"] = batch / ms * 1000
    if peak:
        out["compute_ms_per_step"] = flops / peak * 1000
    return out


def _summarize(report: dict[str, Any]) -> None:
    """Speedups against `generate`, distance from the bound, and what the fast step spends its time on."""
    variants, b = report["variants"], report["bound"]
    base = variants.get("generate", {}).get("tokens_per_s")
    limit = b.get("tokens_per_s_bound_measured") or b.get("tokens_per_s_bound_nominal")
    for result in variants.values():
        if "tokens_per_s" not in result:
            continue
        if base:
            result["speedup_vs_generate"] = result["tokens_per_s"] / base
        if limit:
            result["fraction_of_bound"] = result["tokens_per_s"] / limit
        step = result.get("step")
        if step:
            result["decode_tokens_per_s"] = step["batch"] / step["step_ms"] * 1000
            memory = b.get("memory_ms_per_step_measured") or b.get("memory_ms_per_step_nominal")
            if memory:
                result["step_over_memory_bound"] = step["step_ms"] / memory
            decode_s = step["step_ms"] / 1000 * result.get("engine_stats", {}).get("decode_steps", 0)
            result["prefill_and_host_s"] = max(0.0, result["seconds"] - decode_s)


def format_report(report: dict[str, Any]) -> str:
    b = report["bound"]
    lines = [f"engine benchmark: {report['model']} batch={report['batch']} prompt={report['prompt']} "
             f"new={report['new']} {report['dtype']} on {report['device']} ({report['machine']['gpu'] or 'cpu'})",
             f"{'variant':<14} {'tok/s':>10} {'ms/step':>8} {'vs generate':>11} {'of bound':>9} {'warmup s':>9}"]
    for name, r in report["variants"].items():
        if "error" in r:
            lines.append(f"{name:<14} ERROR {r['error'][:200]}")
            continue
        lines.append(f"{name:<14} {r['tokens_per_s']:>10.0f} {r['ms_per_step']:>8.2f} "
                     f"{r.get('speedup_vs_generate', float('nan')):>10.1f}x "
                     f"{r.get('fraction_of_bound', float('nan')):>9.1%} "
                     f"{r['warmup_s']:>9.1f}")
    for name, r in report["variants"].items():
        step = r.get("step")
        if step:
            lines.append(f"  {name}: decode step {step['step_ms']:.2f} ms at batch {step['batch']} x {step['n_kv']} "
                         f"positions (layers {step['layers_ms']:.2f} ms, "
                         f"head+sampling {step['head_sample_ms']:.2f} ms) "
                         f"= {r['decode_tokens_per_s']:.0f} tok/s decoding; prefill + host "
                         f"{r['prefill_and_host_s']:.2f} s of {r['seconds']:.2f} s"
                         + (f"; {r['step_over_memory_bound']:.1f}x the memory bound"
                            if "step_over_memory_bound" in r else ""))
        for kernel, ms, calls in (step or {}).get("top_kernels", [])[:8]:
            lines.append(f"    {ms:7.3f} ms {calls:5d}x {kernel}")
        if r.get("notes"):
            lines.append(f"  {name} notes: {'; '.join(r['notes'])}")
    gb = 1e9
    lines.append(f"bound per step: weights {b['weight_bytes'] / gb:.2f} GB + KV {b['kv_bytes_per_step'] / gb:.2f} GB "
                 f"(logits {b['logits_bytes_per_step'] / gb:.2f} GB not counted), "
                 f"{b['flops_per_step'] / 1e12:.2f} TFLOP")
    for label in ("measured", "nominal"):
        if f"memory_ms_per_step_{label}" in b:
            bw = b["copy_bandwidth" if label == "measured" else "nominal_bandwidth"]
            lines.append(f"  {label} bandwidth {bw / 1e12:.2f} TB/s -> {b[f'memory_ms_per_step_{label}']:.3f} ms/step "
                         f"-> {b[f'tokens_per_s_bound_{label}']:.0f} tok/s")
    if "compute_ms_per_step" in b:
        lines.append(f"  compute floor {b['compute_ms_per_step']:.3f} ms/step at {b['peak_flops'] / 1e12:.0f} TFLOP/s")
    return "\n".join(lines)
