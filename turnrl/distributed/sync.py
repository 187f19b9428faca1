"""Weight sync from the training ranks to every engine replica after an update.

The ranks hold the policy sharded (FSDP2); every transport starts with a gather of full tensors, one
parameter at a time (`DTensor.full_tensor()`, a collective all ranks join), cast to the engine's dtype.
Full fine-tuning sends every tensor under the plain model's names; LoRA sends only the adapters (`lora_A`,
`lora_B`, and each module's scaling): a vLLM replica with LoRA slots loads them as an adapter, an hf replica
merges them into its own copy of the base weights (W = W0 + s * B @ A, W0 kept from before the first sync).

Transports (`trainer.weight_sync`, `auto` picks by placement):
- `broadcast` (split on GPUs; NCCL): rank 0 and the replicas form their own process group (a TCPStore
  rendezvous at rank 0, outside the trainer's group). Rank 0 packs tensors into ~256 MB byte buckets and
  broadcasts them; replicas unpack them by the layout both sides derive from the same metadata, then load.
  The group is rebuilt when a replica was replaced. On CPUs the same code runs over gloo (for tests).
- `ipc` (colocated on GPUs): rank i and replica i share a GPU; the rank gathers the full tensors on that GPU
  and hands CUDA IPC handles to its replica, which copies from them: no host round trip.
- `object_store` (CPU, or asked for): rank 0 returns the payload from a Ray task, so it lands in Ray's object
  store and each replica fetches it from there; the driver never holds it. The last payload is kept so a
  replacement replica can be brought to the current weights before it serves.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterable, Iterator

import torch

from turnrl.engines.base import EngineError

BUCKET_BYTES = 256 << 20
ALIGN = 256
PEFT_PREFIX = "base_model.model."


@dataclass
class WeightPayload:
    kind: str                                  # full | adapter
    tensors: dict[str, torch.Tensor]
    scaling: dict[str, float] = field(default_factory=dict)      # adapter: peft module name -> alpha / r
    peft_config: dict[str, Any] | None = None


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


# -- replica side: applying a payload ------------------------------------------------------------------------
def adapter_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    """peft module names that have a lora_A tensor in the payload."""
    return sorted({n.split(".lora_A.")[0] for n in tensors if ".lora_A." in n})


def merge_adapter(base: dict[str, torch.Tensor], payload: WeightPayload) -> Iterator[tuple[str, torch.Tensor]]:
    """(base name, W0 + s * B @ A) for every adapted module; `base` maps base names to W0."""
    for module in adapter_modules(payload.tensors):
        a = next(t for n, t in payload.tensors.items() if n.startswith(module + ".lora_A."))
        b = next(t for n, t in payload.tensors.items() if n.startswith(module + ".lora_B."))
        name = module.removeprefix(PEFT_PREFIX) + ".weight"
        w0 = base[name]
        delta = (b.float() @ a.float()) * payload.scaling[module]
        yield name, (w0.float() + delta.to(w0.device)).to(w0.dtype)


async def apply_payload(engine: Any, payload: WeightPayload, version: int, base: dict[str, torch.Tensor]) -> None:
    """Load a payload into an engine; `base` caches the W0 of adapted modules (filled on first use)."""
    if payload.kind == "full":
        await engine.update_weights(payload.tensors.items(), version)
        return
    if engine.capabilities.lora_adapters:  # vLLM with LoRA slots: load the adapter as an adapter
        tensors = {n.replace(".default.", "."): t for n, t in payload.tensors.items()}
        await engine.update_lora(tensors, payload.peft_config or {}, version)
        return
    model = engine.model
    if model is None:
        raise EngineError("this engine can take a LoRA adapter neither as an adapter nor merged: for vllm set "
                          "engine.max_lora_rank to at least model.lora.rank")
    if not base:
        state = model.state_dict()
        for module in adapter_modules(payload.tensors):
            name = module.removeprefix(PEFT_PREFIX) + ".weight"
            base[name] = state[name].detach().clone()
    await engine.update_weights(list(merge_adapter(base, payload)), version)


# -- broadcast buckets ---------------------------------------------------------------------------------------
def bucket_layout(metas: list[TensorMeta], bucket_bytes: int = BUCKET_BYTES) -> list[list[tuple[int, int]]]:
    """Buckets of (tensor index, byte offset), each at most `bucket_bytes` unless one tensor is larger."""
    buckets: list[list[tuple[int, int]]] = []
    offset = bucket_bytes  # forces a first bucket
    for i, meta in enumerate(metas):
        if offset > 0 and offset + meta.nbytes > bucket_bytes:
            buckets.append([])
            offset = 0
        buckets[-1].append((i, offset))
        offset += -(-meta.nbytes // ALIGN) * ALIGN
    return buckets


def _bucket_size(bucket: list[tuple[int, int]], metas: list[TensorMeta]) -> int:
    i, offset = bucket[-1]
    return offset + metas[i].nbytes


def open_group(host: str, port: int, rank: int, world: int, backend: str, timeout_s: float = 600.0) -> Any:
    """A process group of its own (not the default one): rank 0 hosts the TCPStore rendezvous."""
    import torch.distributed as dist
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(dist.PrefixStore("turnrl-weights", store), rank, world)
    return dist.ProcessGroupGloo(dist.PrefixStore("turnrl-weights", store), rank, world, timeout)


def _broadcast(group: Any, buf: torch.Tensor) -> None:
    import torch.distributed as dist
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buf], opts).wait()


def send_buckets(group: Any, tensors: list[torch.Tensor], metas: list[TensorMeta], device: torch.device) -> None:
    for bucket in bucket_layout(metas):
        buf = torch.empty(_bucket_size(bucket, metas), dtype=torch.uint8, device=device)
        for i, offset in bucket:
            flat = tensors[i].to(device, metas[i].dtype).contiguous().view(-1).view(torch.uint8)
            buf[offset:offset + flat.numel()].copy_(flat)
        _broadcast(group, buf)


def receive_buckets(group: Any, metas: list[TensorMeta], device: torch.device) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for bucket in bucket_layout(metas):
        buf = torch.empty(_bucket_size(bucket, metas), dtype=torch.uint8, device=device)
        _broadcast(group, buf)
        for i, offset in bucket:
            m = metas[i]
            out[m.name] = buf[offset:offset + m.nbytes].view(m.dtype).view(m.shape).clone()
    return out


# -- CUDA IPC --------------------------------------------------------------------------------------------------
def ipc_handles(tensors: dict[str, torch.Tensor]) -> list[tuple[str, Any, tuple]]:
    """(name, rebuild function, its arguments) per CUDA tensor; the sender keeps the tensors alive until the
    receiver has copied them."""
    from torch.multiprocessing.reductions import reduce_tensor
    return [(name, *reduce_tensor(t)) for name, t in tensors.items()]


def open_ipc(handles: list[tuple[str, Any, tuple]]) -> dict[str, torch.Tensor]:
    return {name: rebuild(*args) for name, rebuild, args in handles}


# -- driver side ----------------------------------------------------------------------------------------------
def resolve_transport(setting: str, placement: str, gpu: bool) -> str:
    if setting == "auto":
        if not gpu:
            return "object_store"
        return "broadcast" if placement == "split" else "ipc"
    if setting == "ipc" and (not gpu or placement != "colocated"):
        raise ValueError("trainer.weight_sync=ipc needs colocated placement on GPUs (rank and replica on one GPU); "
                         "use auto")
    return setting


class WeightSync:
    """Pushes the ranks' current weights to every live replica (`push`), by one transport."""

    def __init__(self, transport: str, ranks: Any, pool: Any, backend: str):
        self.transport, self.ranks, self.pool, self.backend = transport, ranks, pool, backend
        self._members: list[tuple[int, int]] | None = None   # (slot, generation) of the broadcast group's replicas

    async def push(self, version: int) -> float:
        start = time.perf_counter()
        replicas = self.pool.alive()
        if self.transport == "object_store":
            payload = self.ranks.actors[0].export.remote()
            await asyncio.gather(*(r.export.remote() for r in self.ranks.actors[1:]))
            self.pool.latest = (payload, version)
            done = await self.pool.each(replicas, lambda r: r.handle.update_weights.remote(payload, version))
        elif self.transport == "broadcast":
            # a collective with a dead member would hang until its timeout: ping first (the dead are replaced)
            replicas = await self.pool.each(replicas, lambda r: r.handle.ready.remote())
            if self._members != [(r.slot, r.generation) for r in replicas]:
                await self._form_group(replicas)
            calls = [a.broadcast.remote() for a in self.ranks.actors]
            calls += [r.handle.receive_broadcast.remote(version) for r in replicas]
            await asyncio.gather(*calls)
            done = replicas
        else:  # ipc: rank i -> replica i, same GPU
            handles = await asyncio.gather(*(a.export_ipc.remote() for a in self.ranks.actors))
            done = await self.pool.each(replicas, lambda r: r.handle.update_from_ipc.remote(handles[r.slot], version))
            await asyncio.gather(*(a.release_ipc.remote() for a in self.ranks.actors))
        self.pool.version = version
        for r in done:
            r.ready = True
        return time.perf_counter() - start

    async def _form_group(self, replicas: list[Any]) -> None:
        host, port = await self.ranks.actors[0].address.remote()
        world = 1 + len(replicas)
        metas = await self.ranks.actors[0].weight_meta.remote()
        calls = [self.ranks.actors[0].join_broadcast.remote(host, port, world, self.backend)]
        calls += [r.handle.join_broadcast.remote(host, port, i + 1, world, self.backend, metas)
                  for i, r in enumerate(replicas)]
        await asyncio.gather(*calls)
        self._members = [(r.slot, r.generation) for r in replicas]


def cast_all(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return {n: (t.to(dtype) if dtype is not None and t.is_floating_point() else t) for n, t in named}
