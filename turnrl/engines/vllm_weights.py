"""Weights into the in-process vLLM engine: in-place updates of fused layers, and LoRA adapter directories.

- `WeightLoader.load` (behind `VLLMEngine.update_weights`) reloads tensors in place through the worker's
  `reload_weights` (layerwise: every vLLM layer that receives a tensor is rebuilt, re-packed for the CPU
  kernels, and copied back into the same storage), then resets the prefix cache with running requests
  preempted, so no KV computed with the old weights is reused.
- vLLM fuses q/k/v and gate/up into one layer and rebuilds a layer from what it was sent: a partial update
  (LoRA merged into a few modules) is completed with the other members' checkpoint values (`Checkpoint`
  knows which safetensors file holds each tensor), and refused when one of those members was changed by an
  earlier update.
- `write_adapter` (behind `VLLMEngine.update_lora`): vLLM's public LoRA API (`LoRARequest`) takes a
  directory, so the adapter is written as a peft directory to RAM-backed /dev/shm (a few MB, milliseconds).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from turnrl.engines.base import EngineError


@dataclass
class Checkpoint:
    """Where each checkpoint tensor lives, to complete partial updates of fused layers."""
    files: dict[str, Path] = field(default_factory=dict)          # name -> safetensors file
    modules: dict[str, list[str]] = field(default_factory=dict)   # module path -> its tensor names

    @classmethod
    def scan(cls, model_dir: Path) -> "Checkpoint":
        from safetensors import safe_open
        out = cls()
        for path in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    out.files[name] = path
                    out.modules.setdefault(name.rsplit(".", 1)[0], []).append(name)
        return out

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open
        out = {}
        for name in names:
            with safe_open(str(self.files[name]), framework="pt") as f:
                out[name] = f.get_tensor(name)
        return out


@dataclass
class WeightLoader:
    """Loads (name, tensor) pairs into a running vLLM `LLMEngine`; called on the engine's thread."""
    checkpoint: Checkpoint
    packed: dict[str, list[str]]        # fused vLLM layer -> its member modules (packed_modules_mapping)
    dtype: torch.dtype                  # the engine's model dtype
    changed: set[str] = field(default_factory=set)   # checkpoint names an update has overwritten

    @classmethod
    def for_engine(cls, engine: Any, model_dir: Path) -> "WeightLoader":
        packed = engine.apply_model(lambda m: dict(getattr(m, "packed_modules_mapping", {}) or {}))[0]
        dtype = engine.model_config.dtype
        return cls(Checkpoint.scan(model_dir), packed, dtype)

    def load(self, engine: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        sent = dict(named_tensors)
        tensors = {**sent, **self.complete_layers(sent)}
        dtype = self.dtype
        partial = not set(self.checkpoint.files) <= set(tensors)
        # Layers without checkpoint tensors (rotary tables) and, in a partial update, the layers left alone on
        # purpose would each log a 'failed to load' warning.
        with _quiet(_RELOAD_LOGGERS if partial else _RELOAD_LOGGERS[:1]):
            engine.collective_rpc("reload_weights", kwargs={
                "weights_iterator": ((name, t.detach().to(dtype)) for name, t in tensors.items())})
        self.changed.update(n for n in sent if n in self.checkpoint.files)
        engine.reset_prefix_cache(reset_running_requests=True)

    def complete_layers(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint tensors that share a vLLM layer with a sent tensor but were not sent.

        vLLM rebuilds a layer from the tensors it receives: a layer sent in part (q_proj without k_proj,
        a weight without its bias) would be rebuilt with uninitialized memory in the rest. Layers are found
        through the model's `packed_modules_mapping`; a fused MoE expert layer (all experts in one) is not
        covered: send it whole."""
        members = {m: group for group in self.packed.values() for m in group}
        missing: set[str] = set()
        for name in tensors:
            if name not in self.checkpoint.files:
                continue
            parts = name.split(".")
            for i in range(len(parts) - 1, -1, -1):
                if parts[i] in members:
                    break
            else:
                i = len(parts) - 2  # an unfused module: its own weight and bias
            prefix = ".".join(parts[:i] + ["{}"])
            for sibling in members.get(parts[i], [parts[i]]):
                module = prefix.format(sibling)
                missing.update(n for n in self.checkpoint.modules.get(module, ()) if n not in tensors)
        stale = sorted(missing & self.changed)
        if stale:
            raise EngineError(f"update_weights got part of a fused vLLM layer; the rest ({', '.join(stale[:4])}"
                              f"{'...' if len(stale) > 4 else ''}) was changed by an earlier update and cannot be "
                              f"restored from the checkpoint: send every tensor of those layers")
        return self.checkpoint.read(sorted(missing))


def write_adapter(tensors: dict[str, torch.Tensor], peft_config: dict[str, Any]) -> Path:
    """A peft adapter directory (adapter_model.safetensors + adapter_config.json) in RAM-backed /dev/shm."""
    from safetensors.torch import save_file
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in peft_config:
            raise ValueError(f"peft_config has no {key!r}: pass peft's LoraConfig.to_dict()")
    if not any("lora_A" in n for n in tensors) or not any("lora_B" in n for n in tensors):
        raise ValueError("adapter_tensors holds no lora_A/lora_B tensors: pass peft.get_peft_model_state_dict(model)")
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = Path(tempfile.mkdtemp(prefix="turnrl-lora-", dir=root))
    save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()},
              str(directory / "adapter_model.safetensors"))
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in peft_config.items()}
    (directory / "adapter_config.json").write_text(json.dumps(config, default=str))
    return directory


_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")


@contextlib.contextmanager
def _quiet(names: Iterable[str]) -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
