"""A weight-transfer backend for vLLM servers that need no GPU: tensors handed over as a safetensors file.

vLLM 0.32 moves weights into a running server through its RL API (`/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`) and a pluggable transfer engine
(`vllm.distributed.weight_transfer`, chosen by the server's `--weight-transfer-config`). Its built-in engines
all need CUDA: `nccl`, `sparse_nccl` and `nccl_m2n` build a PyNccl communicator with the trainer, `ipc` shares
CUDA IPC handles. This module adds one engine of our own, registered under `turnrl_file` with vLLM's own
`WeightTransferEngineFactory.register_engine` (the extension point vLLM provides for that):

- trainer side (`write_update`): the tensors are written, in the engine's dtype, to one safetensors file
  under a directory both sides can read (RAM-backed /dev/shm by default; a shared filesystem when the
  server runs on another host), and `/update_weights` carries only its path and tensor names;
- server side (`FileWeightTransferEngine`): `start_weight_update` prepares vLLM's layerwise reload (as the
  IPC engine does), `receive_weights` memory-maps the file and feeds the tensors to `model.load_weights`,
  `finish_weight_update` finalizes the reload (CPU kernels re-packed, values copied into the live storage).
  A partial update of a fused layer (q/k/v, gate/up) is completed from the checkpoint, as in the in-process
  engine (`vllm_weights.WeightLoader.complete_layers`).

`register()` adds the engine to vLLM's registry; `python -m turnrl.engines.vllm_launch` calls it before it
runs vLLM's server, so a server started that way accepts `--weight-transfer-config '{"backend": "turnrl_file"}'`.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from turnrl.engines.vllm_weights import Checkpoint, WeightLoader, _quiet, _RELOAD_LOGGERS

BACKEND = "turnrl_file"


def default_directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def write_update(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None,
                 directory: str | None = None) -> tuple[Path, list[str], int]:
    """One safetensors file holding the tensors (cast to `dtype` when floating); returns (path, names, bytes)."""
    from safetensors.torch import save_file
    tensors = {n: (t.detach().to("cpu", dtype) if dtype is not None and t.is_floating_point() else t.detach().cpu())
               .contiguous() for n, t in named_tensors}
    if not tensors:
        raise ValueError("update_weights got no tensors")
    root = Path(directory or default_directory())
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"turnrl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}.safetensors"
    save_file(tensors, str(path))
    return path, sorted(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


def register() -> None:
    """Add `turnrl_file` to vLLM's transfer-engine registry (in the server process, before vLLM starts)."""
    from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    @dataclass
    class FileInitInfo(WeightTransferInitInfo):
        directory: str = ""          # informational: where the trainer writes its files

    @dataclass
    class FileUpdateInfo(WeightTransferUpdateInfo):
        path: str
        names: list[str] = field(default_factory=list)

    class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
        """Server side of `turnrl_file`: load the tensors of a safetensors file named by the trainer."""
        init_info_cls = FileInitInfo
        update_info_cls = FileUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.loader: WeightLoader | None = None

        def init_transfer_engine(self, init_info: FileInitInfo) -> None:
            if self.loader is None:
                packed = dict(getattr(self.model, "packed_modules_mapping", {}) or {})
                self.loader = WeightLoader(Checkpoint.scan(Path(self.model_config.model)), packed,
                                           self.model_config.dtype)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: FileUpdateInfo) -> None:
            from safetensors import safe_open
            if self.loader is None:
                raise RuntimeError("call /init_weight_transfer_engine before /update_weights")
            with safe_open(update_info.path, framework="pt") as f:
                sent = {name: f.get_tensor(name) for name in (update_info.names or list(f.keys()))}
            tensors = {**sent, **self.loader.complete_layers(sent)}
            dtype = self.loader.dtype
            with _quiet(_RELOAD_LOGGERS):
                self.model.load_weights((n, t.to(dtype)) for n, t in tensors.items())
            self.loader.changed.update(n for n in sent if n in self.loader.checkpoint.files)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
            with _quiet(_RELOAD_LOGGERS):
                finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            pass

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, FileWeightTransferEngine)
    except ValueError:  # imported twice (a forked engine process): already there
        pass

