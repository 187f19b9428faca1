"""Engine replicas as Ray actors, and the pool that starts, calls and replaces them.

`EngineReplica` is an async Ray actor around any turnrl engine (`build_engine`: hf or vllm), placed in its
bundle of the placement group; Ray gives it its GPUs (it sees them as cuda:0..tp-1). Requests from many
trajectories arrive concurrently on the actor's event loop and the engine batches them as it would in one
process. Weights arrive as a payload (object store), over a broadcast group, or as CUDA IPC handles
(`turnrl.distributed.sync`).

`ReplicaPool` (driver side) holds one `ReplicaState` per replica for the router. A replica whose actor dies is
replaced in the background: the dead actor is killed for good, a new one starts in the same bundle, and it is
marked ready only when it holds the current weights: at once when the pool has the last object-store payload
(or no update happened yet), else at the next weight sync. Until then the router sends its traffic elsewhere.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import torch

from turnrl.engines.router import ReplicaDied, ReplicaState
from turnrl.distributed.sync import WeightPayload, apply_payload, open_group, open_ipc, receive_buckets
from turnrl.engines.base import Completion, EngineError, Sampling


class EngineReplica:
    """One engine in its own process (a Ray actor); every method is async."""

    def __init__(self, name: str, model_dir: str, engine_cfg: Any, threads: int = 0):
        from turnrl.rollout.factory import build_engine
        if threads:
            torch.set_num_threads(threads)
        self.name = name
        self.engine = build_engine(engine_cfg, model_dir)
        self.version = 0
        self.base: dict[str, torch.Tensor] = {}
        self.group: Any = None
        self.metas: list[Any] = []
        self.payload_info: dict[str, Any] = {}

    async def ready(self) -> dict[str, Any]:
        import ray
        return {"name": self.name, "version": self.version, "node": ray.util.get_node_ip_address(),
                "gpus": ray.get_gpu_ids()}

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        return await self.engine.generate(prompt_ids, sampling)

    async def update_weights(self, payload: WeightPayload, version: int) -> None:
        await apply_payload(self.engine, payload, version, self.base)
        self.version = version

    async def join_broadcast(self, host: str, port: int, rank: int, world: int, backend: str,
                             meta: dict[str, Any]) -> None:
        self.group = await asyncio.to_thread(open_group, host, port, rank, world, backend)
        self.metas = meta["tensors"]
        self.payload_info = {k: v for k, v in meta.items() if k != "tensors"}

    async def receive_broadcast(self, version: int) -> None:
        if self.group is None:
            raise EngineError(f"replica {self.name} is not in a broadcast group")
        device = self.engine.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        tensors = await asyncio.to_thread(receive_buckets, self.group, self.metas, torch.device(device))
        await self.update_weights(WeightPayload(tensors=tensors, **self.payload_info), version)

    async def update_from_ipc(self, handle: dict[str, Any], version: int) -> None:
        tensors = open_ipc(handle["tensors"])
        try:
            await self.update_weights(WeightPayload(tensors=tensors, **handle["info"]), version)
        finally:
            del tensors
            torch.cuda.synchronize()

    async def sleep(self) -> bool:
        """Free GPU memory while the trainer updates (engines with a sleep mode); False if it cannot."""
        if self.engine.capabilities.sleep:
            await self.engine.sleep(1)
            return True
        return False

    async def wake_up(self) -> None:
        if self.engine.capabilities.sleep:
            await self.engine.wake_up()

    async def fingerprint(self) -> dict[str, float] | None:
        """Sum of each weight (float64) of an engine that exposes its model (hf); None otherwise. Compared with
        the trainer's after a sync, it shows the engine holds what the trainer sent."""
        model = self.engine.model
        if model is None:
            return None
        return {n: float(t.double().sum()) for n, t in model.state_dict().items()}

    async def stats(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, **self.engine.stats}

    async def close(self) -> None:
        await self.engine.close()


class ReplicaPool:
    """The driver's view of the replicas: start, call (deaths become `ReplicaDied`), replace, push weights."""

    def __init__(self, make_actor: Callable[[int, int], Any], n: int):
        self.make_actor = make_actor
        self.replicas = [ReplicaState(slot=i, ready=False) for i in range(n)]
        self.version = 0
        self.latest: tuple[Any, int] | None = None   # (object ref of the last payload, its version)
        self.replaced = 0
        self._replacing: dict[int, asyncio.Task] = {}

    async def start(self) -> list[dict[str, Any]]:
        for r in self.replicas:
            r.handle = self.make_actor(r.slot, r.generation)
        info = await asyncio.gather(*(r.handle.ready.remote() for r in self.replicas))
        for r in self.replicas:
            r.ready = True
        return info

    def alive(self) -> list[ReplicaState]:
        """Replicas with a running actor (ready or waiting for weights), not being replaced."""
        return [r for r in self.replicas if r.slot not in self._replacing and r.handle is not None]

    async def call(self, replica: ReplicaState, prompt_ids: list[int], sampling: Sampling) -> Completion:
        from ray.exceptions import RayActorError, RayTaskError
        try:
            return await replica.handle.generate.remote(prompt_ids, sampling)
        except RayActorError as exc:
            raise ReplicaDied(f"{type(exc).__name__}") from exc
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, Exception) else exc
            raise EngineError(f"replica {replica.name}: {type(cause).__name__}: {cause}") from None

    async def each(self, replicas: list[ReplicaState], call: Callable[[ReplicaState], Any]) -> list[ReplicaState]:
        """Run a remote call on each replica; a replica that died meanwhile is replaced. Returns the ones that
        succeeded."""
        from ray.exceptions import RayActorError
        results = await asyncio.gather(*(call(r) for r in replicas), return_exceptions=True)
        done = []
        for r, result in zip(replicas, results):
            if isinstance(result, RayActorError):
                r.ready = False
                self.replace(r)
            elif isinstance(result, BaseException):
                raise result
            else:
                done.append(r)
        return done

    def replace(self, replica: ReplicaState) -> None:
        if replica.slot not in self._replacing:
            self._replacing[replica.slot] = asyncio.ensure_future(self._replace(replica))

    async def _replace(self, replica: ReplicaState) -> None:
        import ray
        try:
            try:
                ray.kill(replica.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            replica.generation += 1
            replica.handle = self.make_actor(replica.slot, replica.generation)
            await replica.handle.ready.remote()
            self.replaced += 1
            if self.version == 0:
                replica.ready = True
            elif self.latest is not None and self.latest[1] == self.version:
                await replica.handle.update_weights.remote(self.latest[0], self.version)
                replica.ready = True
            # else: the next weight sync brings it up to date and marks it ready
        finally:
            self._replacing.pop(replica.slot, None)

    async def wait_replacements(self) -> None:
        if self._replacing:
            await asyncio.gather(*self._replacing.values(), return_exceptions=True)

    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Push plain tensors (from the driver) to every live replica."""
        import ray
        ref = ray.put(WeightPayload("full", tensors))
        self.latest = (ref, version)
        for r in await self.each(self.alive(), lambda r: r.handle.update_weights.remote(ref, version)):
            r.ready = True
        self.version = version

    async def sleep(self) -> None:
        await self.each(self.alive(), lambda r: r.handle.sleep.remote())

    async def wake_up(self) -> None:
        await self.each(self.alive(), lambda r: r.handle.wake_up.remote())

    async def stats(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(r.handle.stats.remote() for r in self.alive()), return_exceptions=True))

    async def close(self) -> None:
        import ray
        await self.wait_replacements()
        for r in self.replicas:
            if r.handle is not None:
                try:
                    await asyncio.wait_for(r.handle.close.remote(), 10)
                except Exception:  # noqa: BLE001 - closing anyway
                    pass
                ray.kill(r.handle, no_restart=True)
                r.handle = None
