"""`turnrl bench train --profile`: device time grouped by kernel kind."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from turnrl.bench.profile import (
    Kernel,
    _kernels,
    breakdown,
    category,
    host_edges,
    host_syncs,
    idle_gaps,
    launch_delays,
    profile_call,
)
from turnrl.cli import main


@pytest.mark.parametrize("name,kind", [
    ("nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_NNN", "matmul"),
    ("void gemv2T_kernel_val<int, int, float, float>", "matmul"),
    ("aten::addmm", "matmul"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("keys", "attention"),     # turnrl's Triton kernels: forward, keys (dK/dV), queries (dQ)
    ("queries", "attention"),
    ("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", "optimizer"),
    ("Optimizer.step#AdamW.step", "optimizer"),
    ("adamw", "optimizer"),    # turnrl's master AdamW (turnrl/train/adamw_triton.py)
    ("rotary_merge", "fused_elementwise"),   # the fused projections' passes (turnrl/train/projection_triton.py)
    ("swiglu_back", "fused_elementwise"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("triton_poi_fused__unsafe_view_mul_silu_9", "fused_elementwise"),
    ("triton_red_fused_amax_exp_sub_sum_0", "reduction"),
    ("head_logit_stats", "head"),
    ("aten::empty_strided", "other"),
])
def test_kernels_are_grouped_by_kind(name, kind):
    assert category(name) == kind


def test_breakdown_sums_the_kernels_and_ranks_the_top_ones():
    kernels = [Kernel("aten::mm", 10, 0.6), Kernel("Memcpy DtoD (Device -> Device)", 3, 0.1),
               Kernel("flash_fwd_kernel", 2, 0.2), Kernel("aten::empty", 40, 0.1)]
    out = breakdown(kernels, wall_s=2.0, top=2)
    assert out["kernel_s"] == pytest.approx(1.0) and out["busy_fraction"] == pytest.approx(0.5)
    assert out["by_category_s"] == pytest.approx({"matmul": 0.6, "attention": 0.2, "copy": 0.1, "other": 0.1})
    assert list(out["by_category_s"])[0] == "matmul"
    assert sum(out["by_category_fraction"].values()) == pytest.approx(1.0)
    assert [k["name"] for k in out["top"]] == ["aten::mm", "flash_fwd_kernel"]
    assert breakdown([], wall_s=0.0)["busy_fraction"] is None


def test_gpu_side_annotation_ranges_are_not_counted_beside_their_kernels():
    """The optimizer's `record_function` range shows up as a CUDA row spanning the kernels it launched."""
    def row(key, device_type, us, annotation=False):
        return SimpleNamespace(key=key, device_type=device_type, count=1, self_device_time_total=us,
                               self_cpu_time_total=us, is_user_annotation=annotation)
    rows = [row("Optimizer.step#AdamW.step", DeviceType.CUDA, 5000.0, annotation=True),
            row("multi_tensor_apply_kernel", DeviceType.CUDA, 4900.0), row("aten::mm", DeviceType.CPU, 300.0)]
    prof = SimpleNamespace(key_averages=lambda: rows)
    assert _kernels(prof, torch.device("cuda")) == [Kernel("multi_tensor_apply_kernel", 1, 0.0049)]
    # on a CPU the rows are ops' self time: a range's own time is not in its children, so it stays
    assert len(_kernels(prof, torch.device("cpu"))) == 3


def test_bench_train_profiles_one_update_and_one_logprob_pass(tmp_path):
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--model", "tiny-shape", "--batch", "2", "--seq-len", "16", "--steps", "1",
                 "--repeats", "1", "--lora-rank", "0", "--profile", "--json", str(out)]) == 0
    profile = json.loads(out.read_text())["profile"]
    for part in ("update", "logprob_pass"):
        p = profile[part]
        assert 0 < p["kernel_s"] and p["wall_s"] > 0
        assert p["by_category_s"]["matmul"] > 0 and sum(p["by_category_s"].values()) == pytest.approx(p["kernel_s"])
        assert p["top"] and all(k["calls"] >= 1 for k in p["top"])
    assert "optimizer" in profile["update"]["by_category_s"] and "optimizer" not in profile["logprob_pass"]["by_category_s"]


def test_inductor_kernels_with_a_cast_fused_in_are_not_copies():
    assert category("triton_per_fused__to_copy__unsafe_view_add_div_expand_mul_pow_sum_view_7") == "reduction"
    assert category("triton_poi_fused__to_copy_exp_mul_neg_sub_unsqueeze_0") == "fused_elementwise"
    assert category("void at::native::bfloat16_copy_kernel_cuda") == "copy"


def test_idle_gaps_are_the_uncovered_time_between_kernels():
    # microseconds: a and b overlap (two streams), c starts 3 ms after b's end, d 0.5 ms after c
    spans = [(0.0, 1000.0, "a"), (500.0, 2000.0, "b"), (5000.0, 6000.0, "c"), (6500.0, 7000.0, "d")]
    out = idle_gaps(reversed(spans), top=1)
    assert out["launches"] == 4 and out["span_s"] == pytest.approx(0.007)
    assert out["idle_s"] == pytest.approx(0.0035)
    assert out["gaps"] == [{"ms": pytest.approx(3.0), "before": "b", "after": "c"}]
    assert idle_gaps([])["idle_s"] == 0.0


def test_launch_delays_tell_a_starved_device_from_a_queued_one():
    starved = launch_delays([(0.0, 5.0), (100.0, 110.0), (200.0, 204.0)])
    assert starved["kernels"] == 3 and starved["starved"] == 1.0 and starved["median_ms"] == 0.005
    queued = launch_delays([(0.0, 3000.0), (10.0, 4000.0), (20.0, 5000.0), (30.0, 20.0)])   # clock skew: 0
    assert queued["starved"] == 0.25 and queued["median_ms"] == 3.99 and queued["p90_ms"] == 4.98
    assert launch_delays([]) == {"kernels": 0}


def test_host_edges_are_the_device_idle_time_at_the_ends_of_a_call():
    spans = [(5000.0, 6000.0, "gemm"), (1200.0, 2000.0, "copy"), (2500.0, 4000.0, "gemm")]
    host = [(100.0, 700.0, "aten::randperm"), (800.0, 1000.0, "aten::to"), (1050.0, 1150.0, "aten::to"),
            (1100.0, 3000.0, "aten::embedding"),   # ends after the first kernel starts: not before it
            (50.0, 90.0, "aten::zeros")]           # starts before the call
    out = host_edges((100.0, 6500.0), spans, host, top=2)
    assert out["to_first_kernel_ms"] == pytest.approx(1.1)
    assert out["after_last_kernel_ms"] == pytest.approx(0.5)
    assert out["before_first_kernel"] == [{"name": "aten::randperm", "ms": pytest.approx(0.6)},
                                          {"name": "aten::to", "ms": pytest.approx(0.3)}]
    assert host_edges((0.0, 1.0), [], host)["to_first_kernel_ms"] is None


def test_host_syncs_is_empty_off_cuda():
    assert host_syncs(lambda: torch.ones(2).sum().item(), torch.device("cpu")) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_syncs_names_the_line_that_waits_for_the_device():
    x = torch.ones(1000, device="cuda")

    def work():
        y = x * 2                         # queued: no wait
        return float(y.sum())             # a copy to the host: waits
    where = host_syncs(work, torch.device("cuda"))
    assert len(where) == 1 and where[0].startswith("test_bench_profile.py:")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_profile_matches_each_kernel_to_its_launch():
    x = torch.randn(2048, 2048, device="cuda")
    report = profile_call(lambda: [x @ x for _ in range(20)], torch.device("cuda"))
    delay = report["launch_delay"]
    assert delay["kernels"] >= 20 and 0.0 <= delay["p10_ms"] <= delay["median_ms"] <= delay["p90_ms"]
    edges = report["edges"]   # the annotation's range lines up with the kernels on one clock
    assert 0.0 <= edges["to_first_kernel_ms"] < report["wall_s"] * 1e3
    assert 0.0 <= edges["after_last_kernel_ms"] < report["wall_s"] * 1e3
