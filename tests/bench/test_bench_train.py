"""`turnrl bench train` on a tiny shape model on the CPU: the report's fields and the FLOP arithmetic."""

import json

import pytest
import torch

from turnrl.bench.train import SHAPES, model_counts, synthetic_rows, work
from turnrl.cli import main
from turnrl.train.packing import PAD_TO


def test_bench_train_writes_the_report(tmp_path):
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--model", "tiny-shape", "--batch", "4", "--seq-len", "32", "--steps", "1",
                 "--repeats", "2", "--lora-rank", "4", "--peak-tflops", "1", "--json", str(out),
                 "trainer.micro_batch_tokens=64"]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "train" and len(report["runs"]) == 2
    for key in ("update_s", "update_tokens_per_s", "update_tflops_6n", "update_mfu_6n", "update_mfu_with_attention",
                "logprob_tokens_per_s", "logprob_mfu_2n"):
        spread = report["summary"][key]
        assert 0 < spread["min"] <= spread["median"] <= spread["max"]
    run = report["runs"][0]
    w = report["work_per_update"]
    assert run["update_tokens_per_s"] == pytest.approx(w["tokens"] / run["update_s"])
    assert len(run["update_steps_s"]) == 1 and 0 < run["update_steps_s"][0] <= run["update_s"] * 1.001
    assert run["update_gc_pause_s"] >= 0 and report["config"]["weights"] == "float32"
    assert run["update_mfu_6n"] == pytest.approx(run["update_tflops_6n"] / 1.0)
    assert run["update_mfu_with_attention"] > run["update_mfu_6n"]
    assert 0 < w["policy_tokens"] < w["tokens"] <= w["padded_tokens"]
    m = report["model"]
    assert m["n_params"] > m["n_params_non_embedding"] > 0 and 0 < m["n_trainable"] < m["n_params"]
    assert w["flops_6n"] == 6 * m["n_params"] * w["tokens"]
    # executed: body 6N at every token, the fused head (8 V h) at policy tokens only, causal attention
    head = 8 * m["vocab"] * m["hidden"] * w["policy_tokens"]
    assert m["n_params_body"] == m["n_params_non_embedding"]          # tied: the head is the embedding
    assert 6 * m["n_params_body"] * w["tokens"] + head < w["flops_executed"] < w["flops_with_attention"]
    assert run["update_mfu_executed"] == pytest.approx(w["flops_executed"] / run["update_s"] / 1e12)
    cfg = report["config"]
    assert cfg["model"] == "tiny-shape" and cfg["lora"]["rank"] == 4 and cfg["lora"]["alpha"] == 8
    assert cfg["batch"] == 4 and cfg["seq_len"] == 32 and cfg["trainer"]["micro_batch_tokens"] == 64
    assert report["peak_tflops"] == 1 and "loadavg" in report["machine"] and "loadavg_1m" in run


def test_without_a_peak_mfu_is_left_out(tmp_path):
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--model", "tiny-shape", "--batch", "2", "--seq-len", "16", "--steps", "1",
                 "--repeats", "1", "--warmup", "0", "--lora-rank", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["peak_tflops"] is None   # CPU: unknown
    assert "update_mfu_6n" not in report["summary"] and report["runs"][0]["update_mfu_6n"] is None
    assert report["summary"]["update_tflops_6n"]["median"] > 0
    assert report["model"]["n_trainable"] == report["model"]["n_params"]   # full fine-tuning


def test_synthetic_rows_look_like_a_multi_turn_batch():
    rows = synthetic_rows(6, 40, 100, torch.device("cpu"), seed=1, min_fraction=0.5, prompt_fraction=0.5, turns=3,
                          group=3)
    lengths = rows.attention_mask.sum(1)
    assert bool(((lengths >= 20) & (lengths <= 40)).all())
    for row in range(6):
        n = int(lengths[row])
        mask = rows.loss_mask[row]
        assert mask[: n // 2].sum() == 0 and mask[n:].sum() == 0      # prompt and padding out of the loss
        starts = int(((mask[1:] > 0) & (mask[:-1] == 0)).sum())
        assert starts == 3                                           # three policy turns, tool spans between
        assert rows.position_ids[row, n - 1] == n - 1
        assert bool((rows.engine_logprobs[row][mask > 0] <= 0).all())
    # GRPO advantages of rewards in {0, 1}: each group sums to about zero
    per_row = (rows.advantages * rows.loss_mask).sum(1) / rows.loss_mask.sum(1)
    assert per_row.view(2, 3).sum(1).abs().max() < 1e-4


def test_flops_count_real_tokens_and_attention():
    rows = synthetic_rows(2, 8, 50, torch.device("cpu"), min_fraction=1.0)
    counts = {"n_params": 1000, "n_params_body": 600, "layers": 2, "attention_width": 4, "vocab": 50, "hidden": 8}
    w = work(rows, 16, counts)
    assert w["tokens"] == 16 and w["padded_tokens"] == 16 and w["padding_fraction"] == 0
    assert w["flops_6n"] == 6 * 1000 * 16
    assert w["flops_with_attention"] == w["flops_6n"] + 12 * 2 * 4 * (8 ** 2 + 8 ** 2)
    # executed: body at every token, the fused head at policy tokens, causal attention: position i sees i + 1
    # keys; QK^T and PV cost 2 * width FLOPs a (query, key) pair each forward, the backward twice the forward
    pairs = 2 * sum(range(1, 9))
    causal = 3 * (2 + 2) * 4 * pairs * 2      # x layers
    assert w["flops_executed"] == 6 * 600 * 16 + 8 * 50 * 8 * w["policy_tokens"] + causal
    assert work(rows, 16, counts, fused_head=False)["flops_executed"] == 6 * 600 * 16 + 6 * 50 * 8 * 16 + causal


def test_packed_work_counts_packed_lengths():
    rows = synthetic_rows(2, 8, 50, torch.device("cpu"), min_fraction=1.0)
    counts = {"n_params": 1000, "n_params_body": 600, "layers": 2, "attention_width": 4, "vocab": 50, "hidden": 8}
    w = work(rows, 16, counts, packing=True)
    assert w["tokens"] == 16 and w["padded_tokens"] == PAD_TO   # one packed micro-batch, rounded up


def test_bench_train_with_packing(tmp_path):
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--model", "tiny-shape", "--batch", "4", "--seq-len", "32", "--steps", "1",
                 "--repeats", "1", "--lora-rank", "0", "--json", str(out), "trainer.packing=true",
                 "trainer.micro_batch_tokens=64"]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["trainer"]["packing"] is True
    assert report["runs"][0]["grad_norm"] > 0


def test_shape_models_match_their_published_sizes():
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**SHAPES["qwen2.5-0.5b-shape"]))
    counts = model_counts(model)
    assert round(counts["n_params"] / 1e6) == 494          # Qwen2.5-0.5B: 494M with tied embeddings
    assert counts["layers"] == 24 and counts["attention_width"] == 896 and counts["vocab"] == 151936
