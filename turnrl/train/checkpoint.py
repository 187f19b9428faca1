"""Checkpoints written atomically, and everything needed to resume a run exactly.

A checkpoint is a directory `step_NNNNNN/` holding the model (full weights or the LoRA adapter, as
safetensors), optimizer and scheduler state, every RNG state, and `trainer_state.json` (step, data position,
config). It is written into a temporary directory and renamed into place; the `latest` file is replaced
atomically afterwards. A crash at any point leaves either the old or the new checkpoint as `latest`, never
a half-written one.
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

from turnrl.train.policy import is_lora

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
            raise ValueError(f"trainer.resume=latest but {root} has no checkpoint yet; start without resume.")
        path = root / pointer.read_text().strip()
    else:
        path = Path(spec)
    if not (path / "trainer_state.json").is_file():
        raise ValueError(f"'{path}' is not a turnrl checkpoint (no trainer_state.json).")
    return path


def load_model_weights(model: Any, path: Path) -> None:
    from safetensors.torch import load_file
    model_dir = path / "model"
    if is_lora(model):
        from peft import set_peft_model_state_dict
        set_peft_model_state_dict(model, load_file(str(model_dir / "adapter_model.safetensors")))
        return
    state: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not _tied(model, m)]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _tied(model: Any, name: str) -> bool:
    return name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)


def load_checkpoint(path: Path, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
                    generator: torch.Generator) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore everything in place; returns (trainer_state, extra)."""
    load_model_weights(model, path)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    set_rng_state(torch.load(path / "rng.pt", weights_only=False), generator)
    extra = torch.load(path / "extra.pt", weights_only=False) if (path / "extra.pt").is_file() else {}
    return json.loads((path / "trainer_state.json").read_text()), extra
