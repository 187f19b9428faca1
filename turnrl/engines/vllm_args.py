"""What the in-process vLLM engine asks vLLM for: turnrl's engine settings, checked, as `EngineArgs` keywords.

Pure functions (no vLLM import), so every refusal and every keyword is testable without an engine:
- `check_settings` refuses what the in-process engine cannot do (more than one worker: tensors do not
  cross into vLLM's worker processes) and out-of-range numbers, before vLLM is imported.
- `engine_args` is the keyword set: prompts go in as token ids (`skip_tokenizer_init`), logprobs are
  `processed_logprobs` (after the temperature, what the trainer recomputes), the `uni` executor, no sampling
  defaults from the model's generation_config; on CPU a KV budget in bytes and whole prefills (vLLM 0.32 on
  CPU crashes when a seeded request's prefill is split over two steps: it rewinds the request's generator,
  which CPU generators cannot do); on GPU a memory fraction; LoRA slots when `max_lora_rank` is set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class VLLMSettings:
    """The engine's settings (`engine.*`), as `VLLMEngine` takes them."""
    model_path: str
    dtype: str = "auto"
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    cpu_kv_cache_gb: float = 2.0
    seed: int = 0
    max_lora_rank: int = 0
    enable_sleep_mode: bool = False
    max_num_seqs: int = 0


def check_settings(s: VLLMSettings, cpu_threads: int = 0) -> None:
    """ValueError, saying what to set, for settings the in-process engine cannot run."""
    if s.dtype not in DTYPES:
        raise ValueError(f"vllm engine dtype must be one of {DTYPES}, got {s.dtype!r}")
    if s.tensor_parallel_size != 1:
        raise ValueError("the in-process vllm engine runs one worker (tensor_parallel_size=1): with more, "
                         "vLLM's workers live in other processes and update_weights cannot hand them tensors")
    if s.max_model_len <= 0 or s.cpu_kv_cache_gb <= 0 or s.max_num_seqs < 0 \
            or not 0 < s.gpu_memory_utilization <= 1:
        raise ValueError("vllm engine needs max_model_len > 0, cpu_kv_cache_gb > 0, max_num_seqs >= 0 and "
                         "0 < gpu_memory_utilization <= 1")
    if cpu_threads < 0:
        raise ValueError(f"engine.cpu_threads must be >= 0 (0: the trainer's torch threads), got {cpu_threads}")
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        raise ValueError("VLLM_CPU_KVCACHE_SPACE is set and would override engine.cpu_kv_cache_gb; unset it "
                         "and set engine.cpu_kv_cache_gb instead")


def resolved_dtype(dtype: str, on_cpu: bool, cpu_has_native_bf16: bool) -> str:
    """`auto` on an AVX2-only CPU is float32: vLLM-CPU's bf16 there ran 12 against 44 tok/s in float32."""
    return "float32" if dtype == "auto" and on_cpu and not cpu_has_native_bf16 else dtype


def engine_args(s: VLLMSettings, dtype: str, on_cpu: bool) -> dict[str, Any]:
    """`vllm.EngineArgs` keywords for these settings, `dtype` already resolved (`resolved_dtype`)."""
    args: dict[str, Any] = dict(
        model=str(s.model_path), dtype=dtype, max_model_len=s.max_model_len, enforce_eager=s.enforce_eager,
        enable_prefix_caching=s.enable_prefix_caching, seed=s.seed, skip_tokenizer_init=True,
        logprobs_mode="processed_logprobs", distributed_executor_backend="uni",
        generation_config="vllm",      # no sampling defaults from the model's generation_config
        disable_log_stats=True, enable_sleep_mode=s.enable_sleep_mode)
    if s.max_num_seqs:
        args["max_num_seqs"] = s.max_num_seqs
    if on_cpu:
        args["kv_cache_memory_bytes"] = int(s.cpu_kv_cache_gb * (1 << 30))
        args.update(enable_chunked_prefill=False, max_num_batched_tokens=max(s.max_model_len, 4096, s.max_num_seqs))
    else:
        args["gpu_memory_utilization"] = s.gpu_memory_utilization
    if s.max_lora_rank:
        args.update(enable_lora=True, max_lora_rank=s.max_lora_rank, max_loras=1, max_cpu_loras=2)
    return args
