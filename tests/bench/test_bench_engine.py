"""`turnrl bench engine` on a tiny shape model on the CPU: every variant generates the whole workload, the
report carries speedups, and the bound's byte and FLOP counts follow the model's shape."""

import json

import pytest
import torch

from turnrl.bench.engine import bound, build_model
from turnrl.cli import main


def test_bench_engine_writes_the_report(tmp_path, torch_threads):
    out = tmp_path / "engine.json"
    with torch_threads(1):
        assert main(["bench", "engine", "--model", "tiny-shape", "--batch", "3", "--prompt", "5", "--new", "4",
                     "--variants", "generate,hf,fast", "--device", "cpu", "--dtype", "float32",
                     "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "engine" and list(report["variants"]) == ["generate", "hf", "fast"]
    for name, result in report["variants"].items():
        assert "error" not in result, result.get("traceback")
        assert result["generated_tokens"] == 3 * 4
        assert result["tokens_per_s"] == pytest.approx(12 / result["seconds"])
        assert result["speedup_vs_generate"] == pytest.approx(
            result["tokens_per_s"] / report["variants"]["generate"]["tokens_per_s"])
    assert report["variants"]["fast"]["finish_reasons"] == ["length"]


def test_unknown_variants_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown variants"):
        main(["bench", "engine", "--model", "tiny-shape", "--variants", "fast,turbo", "--json", str(tmp_path / "x")])


def test_bound_counts_weights_once_and_the_mean_cached_context():
    model = build_model("tiny-shape", torch.device("cpu"), torch.float32)
    b = bound(model, batch=4, prompt=10, new=6, dev=torch.device("cpu"))
    c = model.config
    assert b["weight_bytes"] == 4 * sum(p.numel() for p in model.parameters())      # tied embeddings once
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    assert b["kv_bytes_per_token"] == per_token and b["kv_bytes_per_step"] == 4 * (10 + 3) * per_token
    assert "tokens_per_s_bound_nominal" not in b                                      # no GPU: no bandwidth
