"""The process's LLM clients, one per (role, endpoint config), and the local engines behind them.

Judges and simulated users are built from plain config in many places (a simulated user is instantiated
once per trajectory), yet all calls to one endpoint must share one concurrency limit, one cache and one
account. `client(cfg, role)` returns the same `LLMClient` for the same role and config; local engines are
shared by every client that names the same model, engine kind, device and dtype (a judge and a simulated user
on one frozen model load it once). `usage_metrics()` reports each role's calls since its last report;
`close_all()` closes every client and engine (the trainer calls it when a run ends).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any

from turnrl.chat.templates import load_template
from turnrl.config.loader import to_dict
from turnrl.config.schema import EngineConfig, LLMConfig
from turnrl.config.secrets import resolve_secret
from turnrl.engines.factory import build_engine
from turnrl.llm.client import EngineTransport, LLMClient, OpenAITransport, Retry, Usage
from turnrl.models import resolve

_clients: dict[tuple[str, str], LLMClient] = {}
_engines: dict[tuple[str, str, str, str], Any] = {}
_reported: dict[str, Usage] = {}
_lock = threading.Lock()
_engine_lock = threading.Lock()   # held while a model loads: never taken on the event loop's thread


def client(cfg: LLMConfig, role: str) -> LLMClient:
    key = (role, json.dumps(to_dict(cfg, redact=False), sort_keys=True))
    with _lock:
        found = _clients.get(key)
        if found is None:
            found = _clients[key] = _build(cfg)
        return found


def _build(cfg: LLMConfig) -> LLMClient:
    retry = Retry(cfg.retries, cfg.backoff_s, cfg.backoff_max_s)
    if cfg.backend == "openai":
        key = resolve_secret(cfg.api_key, "llm.api_key")
        transport: Any = OpenAITransport(cfg.base_url, cfg.model, key, cfg.timeout_s, cfg.extra_body)
        extra: Any = [cfg.base_url, cfg.extra_body]
    else:
        model_dir = resolve(cfg.model)
        template = load_template(model_dir)
        engine_cfg = EngineConfig(kind=cfg.engine, device=cfg.device, dtype=cfg.dtype,
                                  max_batch_size=cfg.max_concurrency, seed=cfg.seed)
        transport = EngineTransport(lambda: _engine(str(model_dir), engine_cfg), template)
        extra = ["local", cfg.engine]
    return LLMClient(transport, cfg.model, cfg.temperature, cfg.max_tokens, cfg.max_concurrency, retry, cfg.cache,
                     cfg.cache_path, extra)


def _engine(model_dir: str, cfg: EngineConfig) -> Any:
    """A frozen local engine, built on first use (blocking: callers run this in a thread)."""
    key = (model_dir, cfg.kind, cfg.device, cfg.dtype)
    with _engine_lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = build_engine(cfg, model_dir)
        return engine


def usage_metrics() -> dict[str, float]:
    """`llm/<role>/<counter>` for the calls made since the previous report (summed over a role's clients)."""
    with _lock:
        totals: dict[str, Usage] = {}
        for (role, _), c in _clients.items():
            totals.setdefault(role, Usage()).add(c.usage)
        out: dict[str, float] = {}
        for role, total in sorted(totals.items()):
            delta = total.minus(_reported.get(role, Usage()))
            _reported[role] = total
            out.update({f"llm/{role}/{k}": float(v) for k, v in dataclasses.asdict(delta).items()})
        return out


async def close_all() -> None:
    with _lock, _engine_lock:
        clients, engines = list(_clients.values()), list(_engines.values())
        _clients.clear()
        _engines.clear()
        _reported.clear()
    for c in clients:
        await c.close()
    for engine in engines:
        await engine.close()
