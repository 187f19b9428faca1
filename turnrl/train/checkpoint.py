"""Checkpoints written atomically, and everything needed to resume a run exactly.

A checkpoint is a directory `step_NNNNNN/` holding the model (full weights or the LoRA adapter, as
safetensors), optimizer and scheduler state, every RNG state, and `trainer_state.json` (step, data position,
config). It is written into a temporary directory and renamed into place; the `latest` file is replaced
atomically afterwards. A crash at any point leaves either the old or the new checkpoint as `latest`, never
a half-written one. `manifest.json` holds each file's size and sha256 (see `turnrl.train.manifest`); every
load checks them first, so a damaged file is a `CheckpointError` naming it and the checkpoint to use instead.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from turnrl.train.manifest import MANIFEST, CheckpointError, read_manifest, reading, verify, write_manifest
from turnrl.train.policy import is_lora

__all__ = ["CheckpointError", "MANIFEST", "read_manifest", "verify", "save_checkpoint", "load_checkpoint",
           "load_model_weights", "find_checkpoint", "read_state", "read_torch"]

LATEST = "latest"


def rng_state(generator: torch.Generator) -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "generator": generator.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], generator: torch.Generator) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    with open(tmp) as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(root: Path, step: int, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
                    generator: torch.Generator, state: dict[str, Any], keep: int = 2,
                    extra: dict[str, Any] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        model.save_pretrained(tmp / "model", safe_serialization=True)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_state(generator), tmp / "rng.pt")
        if extra:
            torch.save(extra, tmp / "extra.pt")
        (tmp / "trainer_state.json").write_text(json.dumps({**state, "step": step}, indent=2))
        write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _atomic_write(root / LATEST, final.name)
    _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints; drop temporary directories left by killed saves."""
    for stale in root.glob(".tmp_step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    if keep <= 0:
        return
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(spec: str, root: Path) -> Path:
    """`latest` (the run's newest complete checkpoint) or a checkpoint directory."""
    if spec == LATEST:
        pointer = root / LATEST
        if not pointer.is_file():
            raise CheckpointError(f"trainer.resume=latest but {root} has no checkpoint yet; start without resume.")
        path = root / pointer.read_text().strip()
    else:
        path = Path(spec)
    if not (path / "trainer_state.json").is_file():
        raise CheckpointError(f"'{path}' is not a turnrl checkpoint (no trainer_state.json).")
    return path


def load_model_weights(model: Any, path: Path, verified: bool = False) -> None:
    """The checkpoint's weights (or LoRA adapter) into `model`; checks the files first unless `verified`."""
    from safetensors.torch import load_file
    if not verified:
        verify(path, "model/")
    model_dir = path / "model"
    if is_lora(model):
        from peft import set_peft_model_state_dict
        adapter = model_dir / "adapter_model.safetensors"
        with reading(path, adapter):
            weights = load_file(str(adapter))
        set_peft_model_state_dict(model, weights)
        return
    state: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with reading(path, file):
            state.update(load_file(str(file)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not _tied(model, m)]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not fit the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")


def read_torch(path: Path, name: str) -> Any:
    """A `torch.save`d file of the checkpoint (not re-verified); a load error names the file."""
    with reading(path, path / name):
        return torch.load(path / name, weights_only=False)


def read_state(path: Path, verified: bool = False) -> dict[str, Any]:
    """The checkpoint's `trainer_state.json` (step, data position, config), checked unless `verified`."""
    if not verified:
        verify(path, "trainer_state.json")
    file = path / "trainer_state.json"
    with reading(path, file):
        state = json.loads(file.read_text())
        int(state["step"])
        return state


def _tied(model: Any, name: str) -> bool:
    return name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)


def load_checkpoint(path: Path, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
                    generator: torch.Generator) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore everything in place (after checking every file against the manifest); returns (trainer_state, extra)."""
    verify(path)
    state = read_state(path, verified=True)
    load_model_weights(model, path, verified=True)
    for name, target in (("optimizer.pt", optimizer), ("scheduler.pt", scheduler)):
        loaded = read_torch(path, name)
        with reading(path, path / name):
            target.load_state_dict(loaded)
    rng = read_torch(path, "rng.pt")
    with reading(path, path / "rng.pt"):
        set_rng_state(rng, generator)
    extra = read_torch(path, "extra.pt") if (path / "extra.pt").is_file() else {}
    return state, extra
