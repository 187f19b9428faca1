"""Data-parallel training ranks: Ray actors that hold the policy sharded with FSDP2 (`fully_shard`).

Each rank joins one torch.distributed group (NCCL on GPUs, gloo on CPUs; rendezvous at rank 0's address),
loads the policy (and the frozen reference, when the KL needs one) and shards every decoder layer and then
the whole model over all ranks (parameters, gradients and optimizer state: FSDP2's ZeRO-3; tied embeddings
stay in the root unit). The optimizer is the single-process trainer's (`build_optimizer`) over the sharded
parameters.

An update follows a plan made on the driver (`turnrl.distributed.balance`): per optimizer step, this rank's
micro-batches (or dummies, so every rank runs the same number of collectives) and the mini-batch's global
normalizer. Each micro-batch runs the single-process `micro_step` with `normalizer / world` (FSDP averages
gradients over ranks), so the summed gradient equals the one-big-batch gradient of `policy_update`; gradient
clipping uses the global norm (DTensor-aware `clip_grad_norm_`).

Checkpoints are written by rank 0 in the single-process format (`turnrl.train.checkpoint`) from full,
unsharded state dicts (`get_model_state_dict` / `get_optimizer_state_dict`, the optimizer's state converted
to torch's plain index-keyed form): a checkpoint resumes on any number of ranks, or in the local trainer.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from turnrl.config.schema import OptimConfig
from turnrl.distributed.sync import TensorMeta, WeightPayload, cast_all, ipc_handles, open_group, send_buckets
from turnrl.train.batching import Rows, to_device
from turnrl.train.host_memory import retain_for_training
from turnrl.train.master import resolve_param_dtype
from turnrl.train.update import Stats, UpdateSettings, means, micro_step

Micro = list[tuple[torch.Tensor, int] | None]


@dataclass
class RankSpec:
    """Everything a rank needs to build its part of the trainer (plain values, picklable)."""
    model_dir: str
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    lora_targets: list[str] | str
    gradient_checkpointing: bool
    optim: OptimConfig
    total_steps: int
    settings: UpdateSettings
    dtype: str                       # trainer dtype: auto | float32 | bfloat16
    send_dtype: str                  # what the engines run in: weights are cast to it before a sync
    seed: int
    gpu: bool
    threads: int = 0
    retain_host_memory: bool = True  # CPU ranks: malloc keeps freed memory (turnrl.train.host_memory)
    param_dtype: str = "auto"        # trainer.param_dtype: the FSDP2 policy's param_dtype (auto: bf16 on GPUs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def shard_model(model: Any, mesh: Any, amp: torch.dtype | None = None) -> None:
    """fully_shard each transformer block (the classes HF lists in `_no_split_modules`), then the root. Under
    bf16 autocast the parameters are gathered in bf16 (half the traffic; the matmuls are bf16 anyway) and
    gradients reduced in fp32 onto the fp32 master shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32) if amp is not None else None
    kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy is not None else {})}
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    blocks = set(getattr(base, "_no_split_modules", None) or [])
    if not blocks:
        raise ValueError(f"cannot find the transformer blocks of {type(base).__name__} to shard (no _no_split_modules)")
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)


def rank_param_dtype(param_dtype: str, amp: torch.dtype | None, device: torch.device) -> torch.dtype | None:
    """The FSDP2 policy's param_dtype for trainer.param_dtype: bf16 on GPU ranks under bf16 autocast unless
    `float32` (None: the fp32 weights themselves, as on CPU ranks)."""
    if param_dtype == "bfloat16" and device.type != "cuda":
        raise ValueError("trainer.param_dtype=bfloat16 runs on GPU ranks; the CPU ranks keep fp32 weights: set "
                         "trainer.param_dtype to auto or float32")
    compute = resolve_param_dtype(param_dtype, amp, device=device)   # auto: the local trainer's rule
    return None if compute == torch.float32 else compute


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _Frozen:
    """An object whose `state_dict()` is a given dict (for `save_checkpoint`'s optimizer argument)."""

    def __init__(self, state: dict[str, Any]):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state


def optimizer_to_plain(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """FSDP's name-keyed full optimizer state -> torch's index-keyed form (as `optimizer.state_dict()`)."""
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: v for n, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[p] for p in g["params"]]} for g in state["param_groups"]]}


def optimizer_from_plain(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {"state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


class TrainRank:
    """One data-parallel rank (a Ray actor, one method at a time)."""

    def __init__(self, rank: int, world: int, spec: RankSpec):
        # FSDP shards the lm_head: the fused head would read it outside the root forward, and the shared-prefix
        # pass calls the decoder alone, so both stay off on ranks whatever the settings say
        spec = replace(spec, settings=replace(spec.settings, fused_head=False, shared_prefix=False))
        self.rank, self.world, self.spec = rank, world, spec
        if spec.threads:
            torch.set_num_threads(spec.threads)
        retain_for_training("cuda" if spec.gpu else "cpu", spec.retain_host_memory)
        self.device = torch.device("cuda", 0) if spec.gpu else torch.device("cpu")
        self.group: Any = None
        self._ipc: dict[str, torch.Tensor] = {}
        self._skeleton: Any = None

    # -- setup ----------------------------------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        import ray
        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, host: str, port: int) -> dict[str, Any]:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from turnrl.train.optim import build_optimizer
        from turnrl.train.policy import Reference, autocast_dtype, load_policy, trainable_parameters
        s = self.spec
        if s.gpu:
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if s.gpu else "gloo", init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.world)
        torch.manual_seed(s.seed)
        self.policy = load_policy(s.model_dir, self.device, s.lora_rank, s.lora_alpha, s.lora_dropout,
                                  s.lora_targets, s.gradient_checkpointing)
        self.reference = Reference(self.policy) if s.settings.needs_ref else None
        self.amp = autocast_dtype(s.dtype, self.device)
        mesh = init_device_mesh(self.device.type, (self.world,))
        compute = rank_param_dtype(s.param_dtype, self.amp, self.device)
        shard_model(self.policy, mesh, compute)
        if self.reference is not None and self.reference.copy is not None:
            shard_model(self.reference.copy, mesh, compute)
        self.params = trainable_parameters(self.policy)
        self.names = [n for n, p in self.policy.named_parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(self.params, s.optim, s.total_steps)
        self.lora = s.lora_rank > 0
        return {"rank": self.rank, "device": str(self.device), "parameters": sum(p.numel() for p in self.params)}

    # -- passes ---------------------------------------------------------------------------------------------
    def _dummy(self, rows: Rows) -> Rows:
        """A one-row micro-batch with a zero loss mask: the collectives run, the gradients it adds are zero."""
        width = int(min(8, max(2, int(rows.host().lengths[0]))))   # host counts: no device wait
        mb = rows.select(torch.tensor([0], device=rows.input_ids.device), width)
        mb.loss_mask = torch.zeros_like(mb.loss_mask)
        mb.advantages = torch.zeros_like(mb.advantages)
        return mb

    def logprobs(self, rows: Rows, micro: Micro, reference: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Logprobs of this rank's rows (without gradients): [(row indices [b], logprobs [b, width])]."""
        from turnrl.train.policy import forward_logprobs
        rows = rows.to(self.device)
        s = self.spec.settings
        ctx = self.reference.model() if reference else contextlib.nullcontext(self.policy)
        out = []
        with ctx as model, torch.no_grad():
            model.eval()
            for spec in micro:
                mb = self._dummy(rows) if spec is None else rows.select(spec[0].to(self.device), spec[1])
                lp, _ = forward_logprobs(model, mb.input_ids, mb.attention_mask, mb.position_ids, s.temperature,
                                         self.amp)
                if spec is not None:
                    out.append((spec[0], lp.float().cpu()))
        return out

    def update(self, rows: Rows, minis: list[tuple[float, Micro]]) -> dict[str, Any]:
        """The optimizer steps of one rollout batch. Returns mean stats, the summed objective per step (add it over
        ranks and divide by the world size for the mini-batch's loss) and, for a single pass, the trainer
        logprobs of this rank's rows."""
        rows = rows.to(self.device)
        s = self.spec.settings
        self.policy.train()
        stats: Stats = {}
        totals, full_norms, mine = [], [], []
        clip = s.grad_clip if s.grad_clip > 0 else float("inf")
        counts = rows.host()
        for normalizer, micro in minis:
            if normalizer == 0:  # same on every rank: all skip together
                continue
            self.optimizer.zero_grad(set_to_none=True)
            total = torch.zeros((), device=self.device)
            for spec in micro:
                if spec is None:
                    dummy = self._dummy(rows)
                    micro_step(self.policy, dummy, torch.tensor([0]), dummy, s, self.amp, normalizer / self.world, {})
                    continue
                index, width = spec
                mb = rows.select(to_device(index, self.device), width)
                total = total + micro_step(self.policy, mb, index, rows, s, self.amp, normalizer / self.world, stats,
                                           selected=counts.selected_in(index))
                mine.append(index)
            norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
            self.optimizer.step()
            self.scheduler.step()
            totals.append(total.float())
            full_norms.append(_full(norm).float().to(self.device))
        # read back once, after every step is queued: nothing in the loop waits for the device
        read = torch.stack([*totals, *full_norms]).cpu().tolist() if totals else []
        objective, norms = read[:len(totals)], read[len(totals):]
        out: dict[str, Any] = {"stats": means(stats),
                               "counts": {k: len(v) for k, v in stats.items()},
                               "objective": objective, "grad_norm": norms, "lr": self.scheduler.get_last_lr()[0]}
        if s.single_pass and mine:
            index = torch.cat(mine).unique()
            out["rows"], out["old_logprobs"] = index, rows.old_logprobs[index.to(self.device)].float().cpu()
        return out

    def full_grads(self) -> dict[str, torch.Tensor] | None:
        """The full gradients left by the last optimizer step (rank 0 gets them; a collective)."""
        grads = {n: _full(p.grad).detach().cpu() for n, p in self.policy.named_parameters() if p.grad is not None}
        return grads if self.rank == 0 else None

    def fingerprint(self) -> dict[str, float] | None:
        """What the engines should hold after a sync (full fine-tuning): the sum of each weight as sent."""
        named = self._named()
        return {n: float(t.double().sum()) for n, t in named.items()} if self.rank == 0 else None

    # -- weights out ------------------------------------------------------------------------------------------
    def _send_dtype(self) -> torch.dtype | None:
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        return dtypes.get(self.spec.send_dtype)

    def _named(self, keep_all: bool = False) -> dict[str, torch.Tensor]:
        """Full tensors for the engines, kept on rank 0 (every rank with `keep_all`). A collective: every rank
        gathers, one tensor at a time."""
        out = {}
        for name, t in self.policy.state_dict().items():
            if self.lora and "lora_" not in name:
                continue
            full = _full(t).detach()
            if self.rank == 0 or keep_all:
                out[name] = full
        return cast_all(out.items(), self._send_dtype())

    def _info(self) -> dict[str, Any]:
        if not self.lora:
            return {"kind": "full"}
        from peft.tuners.lora import LoraLayer
        scaling = {n: float(m.scaling["default"]) for n, m in self.policy.named_modules()
                   if isinstance(m, LoraLayer) and "default" in getattr(m, "scaling", {})}
        config = self.policy.peft_config["default"].to_dict()
        return {"kind": "adapter", "scaling": scaling, "peft_config": json.loads(json.dumps(config, default=list))}

    def export(self) -> WeightPayload | None:
        """The weights as one payload on rank 0 (CPU tensors, for the object store); None elsewhere."""
        named = self._named()
        if self.rank != 0:
            return None
        return WeightPayload(tensors={n: t.cpu() for n, t in named.items()}, **self._info())

    def weight_meta(self) -> dict[str, Any]:
        metas = []
        dtype = self._send_dtype()
        for name, t in self.policy.state_dict().items():
            if self.lora and "lora_" not in name:
                continue
            cast = dtype is not None and t.is_floating_point()
            metas.append(TensorMeta(name, tuple(t.shape), dtype if cast else t.dtype))
        return {"tensors": metas, **self._info()}

    def join_broadcast(self, host: str, port: int, world: int, backend: str) -> None:
        """Rank 0 joins (or rejoins) the weight group as its root; other ranks only gather."""
        if self.rank == 0:
            self.group = open_group(host, port, 0, world, backend)

    def broadcast(self) -> None:
        named = self._named()
        if self.rank == 0:
            metas = self.weight_meta()["tensors"]
            send_buckets(self.group, [named[m.name] for m in metas], metas, self.device)

    def export_ipc(self) -> dict[str, Any]:
        self._ipc = self._named(keep_all=True)
        return {"tensors": ipc_handles(self._ipc), "info": self._info()}

    def release_ipc(self) -> None:
        self._ipc = {}
        torch.cuda.empty_cache()

    # -- checkpoints ------------------------------------------------------------------------------------------
    def _plain_model(self) -> Any:
        from turnrl.train.policy import load_policy
        s = self.spec
        return load_policy(s.model_dir, torch.device("cpu"), s.lora_rank, s.lora_alpha, s.lora_dropout, s.lora_targets)

    def save(self, root: str, step: int, state: dict[str, Any], generator_state: torch.Tensor, keep: int) -> str | None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        from turnrl.train import checkpoint as ckpt
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(self.policy, options=opts)
        optim_state = get_optimizer_state_dict(self.policy, self.optimizer, options=opts)
        extra = {}
        if self.reference is not None and self.reference.copy is not None:
            extra["reference"] = get_model_state_dict(self.reference.copy, options=opts)
        if self.rank != 0:
            return None
        if self._skeleton is None:
            self._skeleton = self._plain_model()
        _, unexpected = self._skeleton.load_state_dict(model_state, strict=False)
        assert not unexpected, unexpected
        generator = torch.Generator()
        generator.set_state(generator_state)
        optimizer = _Frozen(optimizer_to_plain(optim_state, self.names))
        path = ckpt.save_checkpoint(Path(root), step, self._skeleton, optimizer, self.scheduler, generator, state, keep,
                                    extra or None)
        return str(path)

    def load(self, path: str) -> dict[str, Any]:
        """Restore model, optimizer, scheduler (and reference) from a checkpoint of any rank count; returns the
        trainer state and the driver's generator state."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        from turnrl.train import checkpoint as ckpt
        p = Path(path)
        ckpt.verify(p)   # every file against the checkpoint's manifest, before anything is loaded
        plain = self._plain_model()
        ckpt.load_model_weights(plain, p, verified=True)
        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.policy, plain.state_dict(), options=opts)
        del plain
        optim = ckpt.read_torch(p, "optimizer.pt")
        set_optimizer_state_dict(self.policy, self.optimizer, optimizer_from_plain(optim, self.names), options=opts)
        self.scheduler.load_state_dict(torch.load(p / "scheduler.pt", weights_only=False))
        extra = torch.load(p / "extra.pt", weights_only=False) if (p / "extra.pt").is_file() else {}
        if self.reference is not None and self.reference.copy is not None and extra.get("reference") is not None:
            set_model_state_dict(self.reference.copy, extra["reference"], options=opts)
        rng = torch.load(p / "rng.pt", weights_only=False)
        return {"state": json.loads((p / "trainer_state.json").read_text()), "generator": rng["generator"]}

    def close(self) -> None:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.pop("MASTER_ADDR", None)


class RankGroup:
    """The driver's handle on all ranks: every call goes to all of them (FSDP steps are collectives)."""

    def __init__(self, actors: list[Any]):
        self.actors = actors
        self.world = len(actors)

    async def all(self, method: str, *args: Any) -> list[Any]:
        import asyncio
        return list(await asyncio.gather(*(getattr(a, method).remote(*args) for a in self.actors)))

    async def setup(self) -> list[dict[str, Any]]:
        host, port = await self.actors[0].address.remote()
        return await self.all("setup", host, port)

    async def logprobs(self, rows_ref: Any, plan: list[Micro], shape: tuple[int, int], reference: bool = False
                       ) -> torch.Tensor:
        import asyncio
        parts = await asyncio.gather(*(a.logprobs.remote(rows_ref, plan[r], reference)
                                       for r, a in enumerate(self.actors)))
        out = torch.zeros(shape)
        for part in parts:
            for index, lp in part:
                out[index, :lp.shape[1]] = lp
        return out

    async def update(self, rows_ref: Any, plans: list[list[tuple[float, Micro]]]) -> list[dict[str, Any]]:
        import asyncio
        return list(await asyncio.gather(*(a.update.remote(rows_ref, plans[r]) for r, a in enumerate(self.actors))))


def merge_updates(results: list[dict[str, Any]], world: int) -> dict[str, float]:
    """One metrics dict from the ranks' update results: their stats averaged over all micro-batches (as the
    single-process trainer does), the objective (the mini-batch loss the gradients are of, averaged over
    optimizer steps) and the global grad norm."""
    out: dict[str, float] = {}
    keys = {k for r in results for k in r["stats"]}
    for k in sorted(keys):
        n = sum(r["counts"].get(k, 0) for r in results)
        if n:
            out[k] = sum(r["stats"][k] * r["counts"][k] for r in results if k in r["stats"]) / n
    steps = len(results[0]["objective"])
    if steps:
        out["loss/objective"] = sum(sum(r["objective"]) for r in results) / world / steps
        out["grad_norm"] = sum(results[0]["grad_norm"]) / steps
    out["lr"] = results[0]["lr"]
    return out

