"""The fast embedded engine (GPU path of `engine.kind: hf`): slot KV cache, CUDA graphs, device sampling.

decoder.py: the model's forward over the slot cache; sampling.py: per-request-seeded device sampling;
engine.py: the worker (admission, graph-captured decode steps, async completion). `build_hf_engine` picks
this engine or the plain HFEngine from `engine.fast` (auto | on | off).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

from turnrl.engines.fast.decoder import unsupported_reason
from turnrl.engines.fast.engine import FastEngine

log = logging.getLogger(__name__)

__all__ = ["FastEngine", "build_hf_engine", "unsupported_reason"]


def build_hf_engine(model_path: str, fast: Literal["auto", "on", "off"], device: str, dtype: str,
                    max_batch_size: int, max_len: int, gather_ms: float, seed: int, prefix_cache_tokens: int = 0,
                    exact: bool = False, fast_prefix_cache: bool = False, partial_rollout: bool = False,
                    admission_graphs: bool = False, cpu_gemm: bool = True) -> Any:
    """The embedded engine: FastEngine where `fast` asks for it and the model allows, else HFEngine.

    auto: the fast engine on a CUDA device for supported models (Llama, Qwen2/3, Mistral), HFEngine otherwise;
    on: the fast engine on any device (eager on the CPU), an error for unsupported models; off: HFEngine.
    exact: the fast engine on any device with the trainer's batch-invariant forward (turnrl/exact).
    prefix_cache_tokens: the plain engine's prefix cache budget; fast_prefix_cache: the fast engine's (its slots).
    admission_graphs: True packs the fast engine's admissions into buckets, as CUDA graphs where they run; False
    keeps them eager at their exact sizes (admit.py).
    partial_rollout: a weight update interrupts the running requests (turnrl/engines/resume.py).
    cpu_gemm: the plain engine's float32 CPU decode products through the skinny kernel (cpu_decode.py)."""
    from transformers import AutoModelForCausalLM

    from turnrl.engines.hf import HFEngine, resolve_device, resolve_dtype

    plain = dict(device=device, dtype=dtype, max_batch_size=max_batch_size, gather_ms=gather_ms, seed=seed,
                 partial_rollout=partial_rollout)
    if exact:
        if resolve_device(device).type == "cuda" and resolve_dtype(dtype, resolve_device(device)) == torch.float32:
            raise ValueError("engine.exact on a GPU runs in bfloat16 or float16 (float32 tile GEMMs were not "
                             "batch-invariant on the H200): set engine.dtype=auto or bfloat16")
        if fast == "off":
            raise ValueError("engine.exact runs on the slot engine: set engine.fast=auto or on")
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=resolve_dtype(dtype, resolve_device(device)))
        reason = unsupported_reason(model, max_len)
        if reason is not None:
            raise ValueError(f"engine.exact: the slot engine does not support this model: {reason}")
        return FastEngine(model_path, max_len=max_len, model=model, exact=True, **plain)
    if fast == "off" or (fast == "auto" and resolve_device(device).type != "cuda"):
        return HFEngine(model_path, prefix_cache_tokens=prefix_cache_tokens, max_len=max_len, cpu_gemm=cpu_gemm,
                        **plain)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=resolve_dtype(dtype, resolve_device(device)))
    reason = unsupported_reason(model, max_len)
    if reason is None:
        return FastEngine(model_path, max_len=max_len, model=model, prefix_cache=fast_prefix_cache,
                          packed_admissions=None if admission_graphs else False, **plain)
    if fast == "on":
        raise ValueError(f"engine.fast=on, but the fast engine does not support this model: {reason}. "
                         f"Set engine.fast=auto (falls back to the plain engine) or off.")
    log.info("engine.fast=auto: plain HF engine, the fast one does not support this model (%s)", reason)
    return HFEngine(model_path, model=model, prefix_cache_tokens=prefix_cache_tokens, max_len=max_len,
                    cpu_gemm=cpu_gemm, **plain)
