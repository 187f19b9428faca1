"""An engine from its config: the embedded HF/fast engine, in-process vLLM, or running vLLM servers behind the
router (`engine.kind: vllm_server`); each imported only when chosen: vLLM's import alone takes seconds and a lot
of memory."""

from __future__ import annotations

from pathlib import Path

from turnrl.config.schema import EngineConfig
from turnrl.engines.base import Engine
from turnrl.observe.gc_heap import freeze_heap


def build_engine(cfg: EngineConfig, model_dir: str | Path) -> Engine:
    """The engine `cfg` names; with `cfg.gc_freeze`, the process's heap is frozen once it is built
    (turnrl/observe/gc_heap.py)."""
    engine = _build(cfg, model_dir)
    if cfg.gc_freeze:
        freeze_heap()
    return engine


def _build(cfg: EngineConfig, model_dir: str | Path) -> Engine:
    if cfg.kind == "hf":
        from turnrl.engines.fast import build_hf_engine
        return build_hf_engine(str(model_dir), cfg.fast, device=cfg.device, dtype=cfg.dtype,
                               max_batch_size=cfg.max_batch_size, max_len=cfg.max_model_len, gather_ms=cfg.gather_ms,
                               seed=cfg.seed, exact=cfg.exact,
                               prefix_cache_tokens=cfg.prefix_cache_tokens if cfg.enable_prefix_caching else 0,
                               fast_prefix_cache=cfg.fast_prefix_cache and cfg.enable_prefix_caching,
                               admission_graphs=cfg.fast_admission_graphs, partial_rollout=cfg.partial_rollout,
                               cpu_gemm=cfg.cpu_gemm)
    if cfg.kind == "vllm":
        from turnrl.engines.vllm import VLLMEngine
        return VLLMEngine.from_config(str(model_dir), cfg)
    if cfg.kind == "vllm_server":
        from turnrl.engines.vllm_servers import build_server_engine
        return build_server_engine(cfg, model_dir)
    raise ValueError(f"unknown engine kind {cfg.kind!r}")
