"""Packed micro-batches: the layout, and logprobs, gradients and updates equal to the padded path's."""

import copy
import dataclasses
import itertools

import pytest
import torch

from turnrl.bench.train import model_directory, synthetic_rows
from turnrl.config import ConfigError, load_config
from turnrl.train.optim import build_optimizer
from turnrl.train.packing import PAD_TO, pack, packed_attention, packed_tokens, use_packed_attention
from turnrl.train.policy import forward_logprobs, load_policy, trainable_parameters
from turnrl.train.update import UpdateSettings, logprob_pass, policy_update

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models():
    """(padded, packed): the same tiny random model, the second under packed attention."""
    torch.manual_seed(0)
    with model_directory("tiny-shape") as path:
        padded = load_policy(str(path), CPU)
    packed = copy.deepcopy(padded)
    use_packed_attention(packed)
    return padded, packed


@pytest.fixture(scope="module")
def rows():
    return synthetic_rows(6, 48, 1024, CPU, seed=2, group=3)


def test_pack_lays_rows_end_to_end_with_a_padding_segment():
    p = pack(torch.tensor([3, 5, 2]), CPU)
    assert p.rows.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2]
    assert p.cols.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    assert p.length == PAD_TO == packed_tokens(torch.tensor([3, 5, 2]))
    assert p.cu_seqlens.tolist() == [0, 3, 8, 10, PAD_TO] and p.cu_seqlens.dtype == torch.int32
    assert p.max_length == PAD_TO - 10   # the padding tail is the longest segment here
    x = torch.arange(3 * 5).view(3, 5) + 1
    flat = p.gather(x, fill=-1)
    assert flat.shape == (1, PAD_TO) and flat[0, :10].tolist() == [1, 2, 3, 6, 7, 8, 9, 10, 11, 12]
    assert bool((flat[0, 10:] == -1).all())
    back = p.scatter(flat, (3, 5))
    assert back.tolist() == [[0, 2, 3, 0, 0], [0, 7, 8, 9, 10], [0, 12, 0, 0, 0]]   # first columns are 0


def _reference_pack(lengths: list[int]) -> tuple[list[int], list[int], list[int]]:
    rows = [i for i, n in enumerate(lengths) for _ in range(n)]
    cols = [c for n in lengths for c in range(n)]
    return rows, cols, [t for t, c in enumerate(cols) if c > 0]


@pytest.mark.parametrize("lengths", [[3, 5, 2], [0, 4, 0, 1, 7], [1, 1, 1], [0, 0], [PAD_TO, 2 * PAD_TO + 3]])
def test_pack_indices_match_a_token_by_token_reference(lengths):
    p = pack(torch.tensor(lengths), CPU)
    rows, cols, kept = _reference_pack(lengths)
    assert (p.rows.tolist(), p.cols.tolist(), p.kept.tolist()) == (rows, cols, kept)
    n = sum(lengths)
    bounds = [0, *itertools.accumulate(x for x in lengths if x)]
    assert p.cu_seqlens.tolist() == bounds + ([p.length] if p.length > n else [])
    assert p.max_length == max(b - a for a, b in zip(p.cu_seqlens.tolist(), p.cu_seqlens.tolist()[1:]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pack_on_cuda_builds_the_same_indices_without_a_device_sync():
    lengths = torch.tensor([700, 0, 513, 1024, 9])
    host = pack(lengths, CPU)
    torch.cuda.set_sync_debug_mode("error")   # a sync raises
    try:
        p = pack(lengths, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name in ("rows", "cols", "kept", "cu_seqlens"):
        assert getattr(p, name).device.type == "cuda" and getattr(p, name).tolist() == getattr(host, name).tolist()
    assert (p.max_length, p.length) == (host.max_length, host.length)


def test_an_exact_multiple_needs_no_padding_segment():
    p = pack(torch.tensor([PAD_TO, PAD_TO]), CPU)
    assert p.length == 2 * PAD_TO and p.cu_seqlens.tolist() == [0, PAD_TO, 2 * PAD_TO]


@pytest.mark.parametrize("fused_head", [False, True])
def test_packed_logprobs_and_gradients_equal_the_padded_ones(models, rows, fused_head):
    select = rows.loss_mask > 0
    out = []
    for model, packed in ((models[0], None), (models[1], pack(rows.lengths, CPU))):
        model.zero_grad(set_to_none=True)
        lp, ent = forward_logprobs(model, rows.input_ids, rows.attention_mask, rows.position_ids,
                                   with_entropy=True, fused_head=fused_head, select=select, packed=packed)
        (lp * rows.loss_mask).sum().backward()
        out.append((lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ea, ga), (b, eb, gb) = out
    torch.testing.assert_close(a[select], b[select], rtol=0, atol=1e-5)
    torch.testing.assert_close(ea[select], eb[select], rtol=0, atol=1e-5)
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=1e-6)
    assert bool((b[~rows.attention_mask.bool()] == 0).all()) and bool((b[:, 0] == 0).all())


@pytest.mark.parametrize("budget", [100, 4096])
def test_a_packed_update_equals_the_padded_one(models, rows, budget):
    """Same gradient, old logprobs and new weights: packing changes where tokens sit, not the update. A small
    budget makes several packed micro-batches (first-fit) and several padded ones (the logged losses, means
    over micro-batches, then differ with the grouping); a large one makes one of each, with equal metrics."""
    results = []
    for model, packing in ((models[0], False), (models[1], True)):
        model = copy.deepcopy(model)
        params = trainable_parameters(model)
        optimizer, scheduler = build_optimizer(params, load_config(None, []).trainer.optim, 4)
        s = UpdateSettings(micro_batch_tokens=budget, packing=packing)
        batch = dataclasses.replace(rows, old_logprobs=rows.old_logprobs.clone())
        stats = policy_update(model, optimizer, scheduler, batch, s, None, torch.Generator().manual_seed(0), params)
        reference = logprob_pass(model, batch, s, None)
        results.append((stats, batch.old_logprobs, reference, [p.detach().clone() for p in params]))
    (sa, oa, ra, pa), (sb, ob, rb, pb) = results
    assert sa.keys() == sb.keys()
    for key in sa if budget > 1000 else ["grad_norm"]:
        assert sa[key] == pytest.approx(sb[key], rel=1e-4, abs=1e-6), key
    mask = rows.loss_mask > 0
    torch.testing.assert_close(oa[mask], ob[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(ra[mask], rb[mask], rtol=0, atol=1e-5)
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_packed_attention_needs_a_packed_row(models, rows):
    with pytest.raises(ValueError, match="without a packed row"):
        forward_logprobs(models[1], rows.input_ids, rows.attention_mask, rows.position_ids)
    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match="without a packed row"):
        packed_attention(None, q, q, q, None)


def test_sliding_window_models_and_ray_placements_are_refused():
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("qwen2", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=64, vocab_size=64, use_sliding_window=True,
                                  sliding_window=8, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding-window"):
        use_packed_attention(AutoModelForCausalLM.from_config(config))
    with pytest.raises(ConfigError, match="packing"):
        load_config(None, ["trainer.packing=true", "trainer.placement=split"])


def test_the_packed_attention_kernel_is_chosen_and_checked(models, rows):
    """`trainer.packed_attention` names the CUDA kernel; off CUDA both names run the same SDPA path."""
    triton = copy.deepcopy(models[0])
    use_packed_attention(triton, "triton")
    assert triton.config._attn_implementation.endswith("_triton")
    packed = pack(rows.attention_mask.sum(1), CPU)
    a = forward_logprobs(models[1], rows.input_ids, rows.attention_mask, rows.position_ids, packed=packed)[0]
    b = forward_logprobs(triton, rows.input_ids, rows.attention_mask, rows.position_ids, packed=packed)[0]
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="not one of auto, flash, triton"):
        use_packed_attention(copy.deepcopy(models[0]), "fa3")


def test_auto_packed_attention_takes_triton_on_cuda_where_the_head_size_fits(monkeypatch):
    from types import SimpleNamespace

    from turnrl.train import flash_kernel, packing

    config = SimpleNamespace(num_attention_heads=14, hidden_size=896, head_dim=None)   # head size 64
    assert packing.resolve_kernel("flash", config) == "flash" and packing.resolve_kernel("triton", config) == "triton"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert packing.resolve_kernel("auto", config) == "flash"                 # no CUDA: the SDPA path either way
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(flash_kernel, "available", lambda device: True)
    assert packing.resolve_kernel("auto", config) == "triton"
    assert packing.resolve_kernel("auto", SimpleNamespace(num_attention_heads=32, hidden_size=2560,
                                                          head_dim=80)) == "flash"   # 80 is no power of two
    monkeypatch.setattr(flash_kernel, "available", lambda device: False)
    assert packing.resolve_kernel("auto", config) == "flash"                 # no Triton
