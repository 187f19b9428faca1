"""Rollouts on running vLLM servers (`engine.kind: vllm_server`): several URLs behind the sticky, load-aware
router, weights pushed through vLLM's RL API, restarts detected and healed.

- `ServerPool` is the router's pool (`turnrl.engines.router`): one `ReplicaState` per URL, its handle a
  `turnrl.engines.vllm_server.VLLMServer`. A request that finds its server down (refused or dropped
  connection, an HTTP 500 while its `/health` fails (a dying server answers what it had in flight so), or an
  answer sampled with a weight version other than the current one: the server restarted)
  raises `ReplicaDied`; the router retries it on another ready server and asks the pool to `replace` it.
- `replace` starts a revival: the pool polls the server until it answers again (`revive_timeout_s`), brings it
  to the current weights (the last full update's file, kept until the next update, and/or the current LoRA
  adapter), sets its version, and only then marks it ready. A server that stays away is left out and counted.
- `ServerEngine.generate` waits for a revival when no server is ready (one server restarting mid-run), then
  routes once more; a request that still finds no server is an `engine` error on its trajectory (masked).
- Weight updates are written once (one safetensors file, or one adapter directory, in `transfer_dir`) and
  loaded by every ready server in parallel; a server that dies during the update is revived like any other.

`build_server_engine` connects to `engine.urls`, or first starts `engine.launch` servers
(`turnrl.engines.vllm_launch`) and stops them on `close`. An unreachable URL at start is an error that names it.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Iterable

import torch

from turnrl.engines.base import Capabilities, Completion, EngineError, Sampling
from turnrl.engines.hf import native_bf16
from turnrl.engines.router import ReplicaDied, ReplicaState, Router
from turnrl.engines.vllm_launch import launch, stop
from turnrl.engines.vllm_server import ServerDown, VLLMServer
from turnrl.engines.vllm_transfer import write_update
from turnrl.engines.vllm_weights import write_adapter

MAX_SESSIONS = 100_000     # routing records kept for trajectories still running (older ones are dropped)


class ServerPool:
    def __init__(self, servers: list[VLLMServer], revive_timeout_s: float = 600.0, transfer_dir: str | None = None,
                 transfer_dtype: torch.dtype | None = None, launched: list[Any] | None = None):
        self.replicas = [ReplicaState(slot=i, handle=s) for i, s in enumerate(servers)]
        self.revive_timeout_s = revive_timeout_s
        self.transfer_dir = transfer_dir
        self.transfer_dtype = transfer_dtype
        self.launched = launched or []
        self.version = 0
        self.weights: tuple[Path, list[str]] | None = None    # the last full update, for revivals
        self.adapter: Path | None = None                      # the current LoRA adapter directory
        self.reviving: dict[int, asyncio.Task] = {}
        self.stats = {"revived": 0, "revive_failed": 0, "sync_s": 0.0, "sync_bytes": 0}

    async def call(self, replica: ReplicaState, prompt_ids: list[int], sampling: Sampling) -> Completion:
        try:
            return await replica.handle.generate(prompt_ids, sampling)
        except ServerDown as exc:
            raise ReplicaDied(str(exc)) from exc

    def replace(self, replica: ReplicaState) -> None:
        if replica.slot not in self.reviving:
            self.reviving[replica.slot] = asyncio.get_running_loop().create_task(self._revive(replica))

    async def _revive(self, replica: ReplicaState) -> None:
        server: VLLMServer = replica.handle
        deadline = time.monotonic() + self.revive_timeout_s
        try:
            while True:
                try:
                    await self._bring_up_to_date(server)
                    break
                except ServerDown:
                    if time.monotonic() > deadline:
                        self.stats["revive_failed"] += 1
                        print(f"[turnrl] vLLM server {server.url} did not come back within "
                              f"{self.revive_timeout_s:.0f}s: left out of the rollout", flush=True)
                        return
                    await asyncio.sleep(2.0)
        except Exception as exc:  # noqa: BLE001 - it answers but cannot take the weights: leave it out
            self.stats["revive_failed"] += 1
            print(f"[turnrl] vLLM server {server.url} came back but could not be re-synced "
                  f"({type(exc).__name__}: {exc}): left out of the rollout", flush=True)
            return
        else:
            replica.generation += 1
            replica.ready = True
            self.stats["revived"] += 1
            print(f"[turnrl] vLLM server {server.url} is back, re-synced to version {self.version}", flush=True)
        finally:
            self.reviving.pop(replica.slot, None)

    async def _bring_up_to_date(self, server: VLLMServer) -> None:
        await server._request("GET", "/health")
        if self.weights is not None:
            await server.load_file(*self.weights, self.version)
        if self.adapter is not None:
            server.adapter = None      # a restarted server has no adapters
            await server.load_adapter(self.adapter, self.version)
        await server.set_version(self.version)

    async def each(self, fn: Any) -> None:
        """`fn(server)` on every ready server at once; a server found down is revived (and left out)."""
        ready = [r for r in self.replicas if r.ready]

        async def one(r: ReplicaState) -> None:
            try:
                await fn(r.handle)
            except ServerDown:
                r.ready = False
                self.replace(r)
        await asyncio.gather(*(one(r) for r in ready))

    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        start = time.perf_counter()
        path, names, nbytes = await asyncio.to_thread(write_update, tensors.items(), self.transfer_dtype,
                                                      self.transfer_dir)
        previous, self.weights, self.version = self.weights, (path, names), version
        await self.each(lambda s: s.load_file(path, names, version))
        if previous is not None:
            previous[0].unlink(missing_ok=True)
        self.stats["sync_s"] += time.perf_counter() - start
        self.stats["sync_bytes"] += nbytes

    async def update_lora(self, tensors: dict[str, torch.Tensor], peft_config: dict[str, Any], version: int) -> None:
        start = time.perf_counter()
        directory = await asyncio.to_thread(write_adapter, tensors, peft_config)
        previous, self.adapter, self.version = self.adapter, directory, version
        await self.each(lambda s: s.load_adapter(directory, version))
        if previous is not None:  # requests of the last version are done: the trainer syncs between rollouts
            shutil.rmtree(previous, ignore_errors=True)
        self.stats["sync_s"] += time.perf_counter() - start

    async def close(self) -> None:
        for task in list(self.reviving.values()):
            task.cancel()
        for r in self.replicas:
            await r.handle.close()
        if self.weights is not None:
            self.weights[0].unlink(missing_ok=True)
        if self.adapter is not None:
            shutil.rmtree(self.adapter, ignore_errors=True)
        if self.launched:
            await asyncio.to_thread(stop, self.launched)
            self.launched = []


class ServerEngine(Router):
    """The `Engine` over vLLM servers: routing and retries from `Router`, weights and revivals from the pool.

    Capabilities: the servers return processed logprobs (after top-p/top-k), so truncated sampling is refused
    as in the in-process vLLM engine; LoRA adapters are loaded as adapters when the servers have LoRA slots;
    no sleep mode (the servers are not ours to put to sleep)."""

    def __init__(self, pool: ServerPool, retries: int = 2, lora: bool = False):
        super().__init__(pool, retries)
        self.lora_enabled = lora
        self.capabilities = Capabilities(truncated_sampling=False, lora_adapters=lora, sleep=False, partial_rollout=True)

    @property
    def version(self) -> int:
        return self.pool.version

    @property
    def urls(self) -> list[str]:
        return [r.handle.url for r in self.pool.replicas]

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        if len(self.sticky) > MAX_SESSIONS:
            self.sticky.clear()
            self.assignments.clear()
        try:
            return await super().generate(prompt_ids, sampling)
        except EngineError:
            pending = list(self.pool.reviving.values())
            if any(r.ready for r in self.pool.replicas) or not pending:
                raise
        # every server is down and at least one is coming back: wait for it, then try once more
        self.stats.failed -= 1
        self.stats.retries += 1
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        return await super().generate(prompt_ids, sampling)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await self.pool.update_weights(dict(named_tensors), version)

    async def update_lora(self, adapter_tensors: dict[str, torch.Tensor], peft_config: dict[str, Any],
                          version: int) -> None:
        if not self.lora_enabled:
            raise EngineError("the vLLM servers have no LoRA slots: set engine.max_lora_rank to at least "
                              "model.lora.rank")
        await self.pool.update_lora(adapter_tensors, peft_config, version)

    async def reset_prefix_cache(self) -> None:
        await self.pool.each(lambda s: s.reset_prefix_cache())

    def metrics(self) -> dict[str, float]:
        out = self.stats.take()
        out.update({f"servers/{k}": float(v) for k, v in self.pool.stats.items()})
        self.pool.stats["sync_s"] = self.pool.stats["sync_bytes"] = 0   # per step; revivals count up
        out["servers/ready"] = float(sum(r.ready for r in self.pool.replicas))
        return out


def model_dtype(model_dir: str | Path, dtype: str) -> torch.dtype | None:
    """The dtype the servers hold their weights in (the update file is written in it)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    import json
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except OSError:
        return None
    name = config.get("torch_dtype") or config.get("dtype")
    return getattr(torch, name, None) if isinstance(name, str) else None


async def connect_all(servers: list[VLLMServer], model_dir: Path) -> None:
    """Connect to every server; one that holds other weights than it started with (an earlier run updated it)
    is first brought back to the checkpoint's, so version 0 means the base model everywhere."""
    async def one(server: VLLMServer) -> None:
        if await server.connect() != "default":
            for path in sorted(model_dir.glob("*.safetensors")):
                from safetensors import safe_open
                with safe_open(str(path), framework="pt") as f:
                    names = sorted(f.keys())
                await server.load_file(path, names, 0)
        await server.set_version(0)
    try:
        await asyncio.gather(*(one(s) for s in servers))
    finally:  # their HTTP clients belong to this event loop; the rollout's loop makes its own
        for s in servers:
            await s.close()


def build_server_engine(cfg: Any, model_dir: str | Path, log_dir: Path | None = None) -> ServerEngine:
    """`engine.kind: vllm_server`: connect to `cfg.urls`, or start `cfg.launch` servers first."""
    lora = cfg.max_lora_rank > 0
    launched: list[Any] = []
    urls = list(cfg.urls)
    tag = f"turnrl-{uuid.uuid4().hex[:8]}"
    launch_dtype = cfg.dtype
    if cfg.dtype == "auto" and not torch.cuda.is_available() and not native_bf16(torch.device("cpu")):
        launch_dtype = "float32"   # servers started here run on this CPU: its bf16 is a slow fallback (hf.native_bf16)
    if cfg.launch:
        settings = dict(dtype=launch_dtype, max_model_len=cfg.max_model_len, seed=cfg.seed, enforce_eager=cfg.enforce_eager,
                        enable_prefix_caching=cfg.enable_prefix_caching, max_lora_rank=cfg.max_lora_rank,
                        max_num_seqs=cfg.max_num_seqs)
        directory = log_dir or Path("runs") / "vllm-servers" / tag
        print(f"[turnrl] starting {cfg.launch} vLLM server(s); logs in {directory}", flush=True)
        launched = launch(str(model_dir), cfg.launch, directory, settings, cfg.cpu_kv_cache_gb, cfg.launch_timeout_s)
        urls = [s.url for s in launched]
    dtype = model_dtype(model_dir, launch_dtype if cfg.launch else cfg.dtype)
    servers = [VLLMServer(u, tag, lora, cfg.request_timeout_s, cfg.served_model_name, dtype, cfg.transfer_dir or None,
                          cfg.seed + i, cfg.partial_rollout) for i, u in enumerate(urls)]
    try:
        asyncio.run(connect_all(servers, Path(model_dir)))
    except BaseException:
        if launched:
            stop(launched)
        raise
    pool = ServerPool(servers, cfg.revive_timeout_s, cfg.transfer_dir or None, dtype, launched)
    return ServerEngine(pool, cfg.request_retries, lora)
