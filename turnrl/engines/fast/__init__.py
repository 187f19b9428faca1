"""The fast embedded engine (GPU path of `engine.kind: hf`): slot KV cache, CUDA graphs, device sampling.

decoder.py: the model's forward over the slot cache; sampling.py: per-request-seeded device sampling;
engine.py: the worker (admission, graph-captured decode steps, async completion). `build_hf_engine` picks
this engine or the plain HFEngine from `engine.fast` (auto | on | off).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from turnrl.engines.fast.decoder import unsupported_reason
from turnrl.engines.fast.engine import FastEngine

log = logging.getLogger(__name__)

__all__ = ["FastEngine", "build_hf_engine", "unsupported_reason"]


def build_hf_engine(model_path: str, fast: Literal["auto", "on", "off"], device: str, dtype: str,
                    max_batch_size: int, max_len: int, gather_ms: float, seed: int, prefix_cache_tokens: int = 0) -> Any:
    """The embedded engine: FastEngine where `fast` asks for it and the model allows, else HFEngine.

    auto: the fast engine on a CUDA device for supported models (Llama, Qwen2/3, Mistral), HFEngine otherwise;
    on: the fast engine on any device (eager on the CPU), an error for unsupported models; off: HFEngine."""
    from transformers import AutoModelForCausalLM

    from turnrl.engines.hf import HFEngine, resolve_device, resolve_dtype

    plain = dict(device=device, dtype=dtype, max_batch_size=max_batch_size, gather_ms=gather_ms, seed=seed)
    if fast == "off" or (fast == "auto" and resolve_device(device).type != "cuda"):
        return HFEngine(model_path, prefix_cache_tokens=prefix_cache_tokens, **plain)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=resolve_dtype(dtype, resolve_device(device)))
    reason = unsupported_reason(model, max_len)
    if reason is None:
        return FastEngine(model_path, max_len=max_len, model=model, **plain)
    if fast == "on":
        raise ValueError(f"engine.fast=on, but the fast engine does not support this model: {reason}. "
                         f"Set engine.fast=auto (falls back to the plain engine) or off.")
    log.info("engine.fast=auto: plain HF engine, the fast one does not support this model (%s)", reason)
    return HFEngine(model_path, model=model, prefix_cache_tokens=prefix_cache_tokens, **plain)
