"""A random-init Qwen2 model on the SmolLM2 tokenizer, for the fast engine's multi-turn benchmark.

    python benchmarks/fast_prefix/make_model.py OUT_DIR --tokenizer DIR [--shape qwen2.5-0.5b|tiny]
        [--device auto|cpu|cuda] [--seed 0]

`--shape qwen2.5-0.5b` (the default) is the Qwen2.5-0.5B architecture (`qwen2.5-0.5b-shape` of
turnrl/bench/train.py: 24 layers, hidden 896, 14 query / 2 KV heads, MLP 4864, tied embeddings, rope theta 1e6)
with ONE difference: the vocabulary is the tokenizer's (SmolLM2's 49,152 tokens), not Qwen's 151,936, so the
embedding / LM head is 44 M parameters instead of 136 M (about 0.40 B parameters in all instead of 0.49 B) and
the head's share of each decode step is smaller than in the real model. `--shape tiny` is a 2-layer Qwen2 of the
same kind (hidden 64) for CPU checks of the script.

The model class is Qwen2ForCausalLM (model_type qwen2), which the fast engine supports
(turnrl/engines/fast/decoder.py `unsupported_reason` is checked before anything is written). Weights are random
(seeded; normal init on the chosen device, the GPU when there is one), saved as bf16 safetensors. The
tokenizer files and the chat template are copied unchanged from `--tokenizer` (a model directory such as
~/.cache/turnrl/models/smollm2-135m-instruct, or only its tokenizer files): the benchmark renders chats with
that template and stops turns at its end-of-turn token. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

# Qwen2 keyword arguments per shape, the vocabulary left out (the tokenizer's is used). qwen2.5-0.5b is read from
# turnrl/bench/train.py's "qwen2.5-0.5b-shape" so that the two benchmarks measure the same body.
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=4096, rms_norm_eps=1e-6)
SHAPE_NAMES = ("qwen2.5-0.5b", "tiny")


def shape_kwargs(shape: str) -> dict[str, Any]:
    if shape == "tiny":
        return dict(TINY)
    from turnrl.bench.train import SHAPES as TRAIN_SHAPES
    kwargs = dict(TRAIN_SHAPES[f"{shape}-shape"])
    assert kwargs.pop("model_type") == "qwen2", shape
    kwargs.pop("vocab_size")
    return kwargs


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model")


def copy_tokenizer(src: Path, out: Path) -> list[str]:
    """Copy the tokenizer files (and the chat template) that exist in `src`; return their names."""
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if "tokenizer_config.json" not in copied:
        raise SystemExit(f"error: {src} holds no tokenizer_config.json: not a tokenizer directory")
    for name in copied:
        shutil.copyfile(src / name, out / name)
    return copied


def build(out: Path, tokenizer_dir: Path, shape: str = "qwen2.5-0.5b", device: str = "auto", seed: int = 0,
          max_len: int = 4096) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from turnrl.engines.fast import unsupported_reason

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    copied = copy_tokenizer(tokenizer_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    if not tokenizer.chat_template:
        raise SystemExit(f"error: the tokenizer in {tokenizer_dir} has no chat template")
    config = Qwen2Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         use_sliding_window=False, **shape_kwargs(shape))
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       "cpu" if device == "auto" else device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        with dev:   # init on the device: seconds on a GPU instead of a minute on a few CPU cores
            model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    reason = unsupported_reason(model, max_len)
    if reason is not None:
        raise SystemExit(f"error: the fast engine would not run this model: {reason}")
    model.config.name_or_path = f"random-init {shape} shape (Qwen2), vocab {len(tokenizer)} from {tokenizer_dir}"
    model.save_pretrained(out, safe_serialization=True)
    info = {"shape": shape, "architecture": type(model).__name__, "vocab_size": config.vocab_size,
            "parameters": sum(p.numel() for p in model.parameters()), "dtype": "bfloat16", "device": str(dev),
            "seed": seed, "tokenizer_from": str(tokenizer_dir), "tokenizer_files": copied,
            "seconds": round(time.perf_counter() - t0, 2)}
    (out / "bench-model.json").write_text(json.dumps(info, indent=2))
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="directory to write (created; existing files are overwritten)")
    p.add_argument("--tokenizer", type=Path, required=True,
                   help="directory with the tokenizer files and chat template (e.g. the SmolLM2 model directory)")
    p.add_argument("--shape", choices=SHAPE_NAMES, default="qwen2.5-0.5b")
    p.add_argument("--device", default="auto", help="where to run the random init: auto (cuda if any), cpu, cuda")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not a.tokenizer.is_dir():
        raise SystemExit(f"error: --tokenizer {a.tokenizer} is not a directory")
    info = build(a.out, a.tokenizer, a.shape, a.device, a.seed)
    print(f"wrote {a.out}: {info['architecture']} {info['shape']} shape, vocab {info['vocab_size']}, "
          f"{info['parameters'] / 1e6:.1f} M parameters, bf16, init on {info['device']} ({info['seconds']} s)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
