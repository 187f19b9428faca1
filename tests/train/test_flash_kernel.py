"""The packed trainer's Triton attention (forward and backward) against SDPA per row, on the CPU through Triton's
interpreter; on a GPU against torch's varlen flash kernel, and run to run."""

import importlib.util

import pytest
import torch

from turnrl.config import ConfigError, load_config
from turnrl.train import flash_kernel

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton (its interpreter runs on the CPU)")


def rows_reference(q, k, v, lengths, scale):
    """Causal SDPA row by row, key/value heads repeated for their query heads: [N, H, D]."""
    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lengths:
        qq, kk, vv = (x[start:start + n].transpose(0, 1) for x in (q, k, v))
        kk, vv = kk.repeat_interleave(group, 0), vv.repeat_interleave(group, 0)
        out.append(torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale)
                   .transpose(0, 1))
        start += n
    return torch.cat(out)


def case(lengths, heads, kv, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, dim, generator=g).to(dtype).requires_grad_() for h in (heads, kv, kv))
    grad = torch.randn(n, heads, dim, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, grad, cu


def run(q, k, v, grad, cu, max_length, scale):
    out = flash_kernel.packed_attention(q, k, v, cu, max_length, scale)
    out.backward(grad)
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    return out.detach(), grads


@needs_triton
@pytest.mark.parametrize(("lengths", "heads", "kv", "dim", "blocking"), [
    # rows of one token, under a block, on a block's edge, over several blocks; a group of 7 as Qwen2.5-0.5B
    ([1, 5, 64, 130, 200], 14, 2, 64, None),
    # small blocks: many diagonal and full steps, a key program wider than a query step (and a register cap)
    ([3, 70, 129, 33], 4, 2, 16, ((32, 16, 4, 3), (64, 16, 4, 2, 128), (32, 32, 4, 3))),
    ([96, 17], 6, 6, 32, ((64, 64, 4, 3), (32, 32, 4, 3), (64, 32, 4, 3))),     # no grouping
])
def test_forward_and_gradients_equal_sdpa_per_row(interpreted, monkeypatch, lengths, heads, kv, dim, blocking):
    """float32 (exact dots): the output and dQ, dK, dV equal causal SDPA run row by row, in float64."""
    if blocking:
        for name, value in zip(("FORWARD", "KEYS", "QUERIES"), blocking):
            monkeypatch.setattr(flash_kernel, name, value)
    q, k, v, grad, cu = case(lengths, heads, kv, dim, torch.float32)
    scale = dim ** -0.5
    out, grads = run(q, k, v, grad, cu, max(lengths), scale)
    ref_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = rows_reference(*ref_inputs, lengths, scale)
    want.backward(grad.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, ref_inputs):
        torch.testing.assert_close(got.double(), ref.grad, rtol=1e-5, atol=1e-5)


@needs_triton
def test_atomic_dq_gives_the_same_gradients(interpreted, monkeypatch):
    """ATOMIC_DQ (dQ added by the key programs, no dQ kernel): the same gradients, to float32 rounding."""
    lengths = [3, 70, 129]
    q, k, v, grad, cu = case(lengths, 4, 2, 16, torch.float32, seed=4)
    monkeypatch.setattr(flash_kernel, "KEYS", (64, 32, 4, 3))
    _, want = run(q, k, v, grad, cu, max(lengths), 0.25)
    monkeypatch.setattr(flash_kernel, "ATOMIC_DQ", True)
    _, got = run(q, k, v, grad, cu, max(lengths), 0.25)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)


@needs_triton
def test_the_grid_order_changes_nothing_but_the_order(interpreted, monkeypatch):
    """SCHEDULE 'across' (longest programs of every segment first) and 'per_segment': each program computes the
    same thing, so the output and gradients are equal bit for bit."""
    lengths = [3, 70, 129, 33]
    q, k, v, grad, cu = case(lengths, 4, 2, 16, torch.float32, seed=6)
    monkeypatch.setattr(flash_kernel, "KEYS", (32, 16, 4, 3))
    results = {}
    for schedule in ("across", "per_segment"):
        monkeypatch.setattr(flash_kernel, "SCHEDULE", schedule)
        results[schedule] = run(q, k, v, grad, cu, max(lengths), 0.25)
        assert flash_kernel.blocking()["SCHEDULE"] == schedule
    (out_a, grads_a), (out_b, grads_b) = results.values()
    assert torch.equal(out_a, out_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


@needs_triton
@pytest.mark.parametrize("keys", [(32, 16, 4, 3), (64, 16, 4, 3)])
def test_the_flat_key_walk_gives_the_same_bits(interpreted, monkeypatch, keys):
    """FLAT_KEYS (one loop over head and query step, every step masked) against the per-head loops: the same
    sums in the same order, so equal bit for bit; rows shorter than, equal to and longer than a key block."""
    lengths = [3, 70, 129, 33, 64]
    q, k, v, grad, cu = case(lengths, 6, 2, 16, torch.float32, seed=8)
    monkeypatch.setattr(flash_kernel, "KEYS", keys)
    results = []
    for flat in (False, True):
        monkeypatch.setattr(flash_kernel, "FLAT_KEYS", flat)
        results.append(run(q, k, v, grad, cu, max(lengths), 0.25))
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.equal(out_a, out_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_grid_order_and_size_are_checked(monkeypatch):
    """An unknown SCHEDULE, and more blocks (or rows) than CUDA's grid takes, fail with what to do."""
    monkeypatch.setattr(flash_kernel, "SCHEDULE", "random")
    with pytest.raises(ValueError, match="'across' or 'per_segment'"):
        flash_kernel._grid(4, 2, 3)
    monkeypatch.setattr(flash_kernel, "SCHEDULE", "across")
    assert flash_kernel._grid(4, 2, 3) == ((3, 2, 4), True)
    monkeypatch.setattr(flash_kernel, "_GRID_LIMIT", 3)
    with pytest.raises(ValueError, match="row's 4 blocks .*packed_attention: flash"):
        flash_kernel._grid(4, 2, 3)
    monkeypatch.setattr(flash_kernel, "SCHEDULE", "per_segment")
    assert flash_kernel._grid(2, 2, 3) == ((2, 2, 3), False)
    with pytest.raises(ValueError, match="5 rows in one micro-batch .*micro_batch_tokens"):
        flash_kernel._grid(2, 2, 5)


@needs_triton
def test_bf16_stays_within_its_rounding(interpreted):
    """bf16 inputs (dots widened by the interpreter): the output within bf16's rounding of the float64 result,
    and a padding segment (the packed row's tail) changes nothing in the rows before it."""
    lengths = [40, 150, 7]
    q, k, v, grad, cu = case(lengths, 14, 2, 64, torch.bfloat16, seed=3)
    out, grads = run(q, k, v, grad, cu, max(lengths), 0.125)
    want = rows_reference(*(x.detach().double() for x in (q, k, v)), lengths, 0.125)
    assert (out.double() - want).abs().max() < 2e-2
    tail = torch.cat((cu, cu[-1:] + 9))
    pad = [torch.cat((x.detach(), torch.randn(9, *x.shape[1:]).to(x.dtype))).requires_grad_() for x in (q, k, v)]
    out2, grads2 = run(*pad, torch.cat((grad, torch.zeros(9, *grad.shape[1:], dtype=grad.dtype))), tail, 150,
                       0.125)
    assert torch.equal(out2[:len(out)], out)
    for a, b in zip(grads2, grads):
        assert torch.equal(a[:len(b)], b)


@needs_triton
def test_under_torch_compile(interpreted):
    """A custom op with a fake kernel and autograd: a compiled graph (fullgraph) calls it, gradients flow."""
    lengths = [20, 45]
    q, k, v, grad, cu = case(lengths, 4, 2, 16, torch.float32, seed=5)
    compiled = torch.compile(lambda *a: flash_kernel.packed_attention(*a) * 2, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v, cu, 45, 0.25)
    out.backward(grad)
    got = [x.grad.clone() for x in (q, k, v)]
    q.grad = k.grad = v.grad = None
    want, grads = run(q, k, v, grad * 2, cu, 45, 0.25)
    assert torch.equal(out.detach(), want * 2)
    for a, b in zip(got, grads):
        assert torch.equal(a, b)


def test_bad_inputs_and_blockings_are_refused(monkeypatch):
    q = torch.zeros(10, 4, 24)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="power of two"):
        flash_kernel.forward(q, q[:, :2], q[:, :2], cu, 10, 0.1)
    q, kv = torch.zeros(10, 4, 16), torch.zeros(10, 2, 16)
    with pytest.raises(ValueError, match="multiple of KV"):
        flash_kernel.forward(q, q[:, :3], q[:, :3], cu, 10, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        flash_kernel.forward(q, q[:, :2], q[:, :2], cu, 10, 0.1)
    with pytest.raises(ValueError, match="int32"):
        flash_kernel.forward(q, kv, kv, cu.long(), 10, 0.1)
    monkeypatch.setattr(flash_kernel, "FORWARD", (64, 128, 4, 3))
    with pytest.raises(ValueError, match="FORWARD"):
        flash_kernel.forward(q, kv, kv, cu, 10, 0.1)
    monkeypatch.setattr(flash_kernel, "FORWARD", (64, 64, 4))
    with pytest.raises(ValueError, match="register cap"):
        flash_kernel.forward(q, kv, kv, cu, 10, 0.1)


def test_the_config_key_needs_packing():
    assert load_config(None, ["trainer.packing=true", "trainer.packed_attention=triton"]).trainer.packed_attention \
        == "triton"
    with pytest.raises(ConfigError, match="packing: true"):
        load_config(None, ["trainer.packed_attention=triton"])
    with pytest.raises(ConfigError, match="packed_attention"):
        load_config(None, ["trainer.packing=true", "trainer.packed_attention=fa3"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_it_matches_varlen_flash_and_repeats_bit_for_bit():
    """Qwen2.5-0.5B heads, bf16, rows of 512-1024 tokens: output and gradients within bf16 noise of torch's
    varlen FA2 (against the float32 reference each is as close as the other), and two runs give the same bits."""
    from turnrl.train.packing import _varlen

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(512, 1025, (16,), generator=g).tolist()
    q, k, v, grad, cu = (x.to(dev) if i == 4 else x.detach().to(dev).requires_grad_(i < 3) for i, x in
                         enumerate(case(lengths, 14, 2, 64, torch.bfloat16)))
    out, grads = run(q, k, v, grad, cu, max(lengths), 0.125)
    again, grads_again = run(q, k, v, grad, cu, max(lengths), 0.125)
    assert torch.equal(out, again) and all(torch.equal(a, b) for a, b in zip(grads, grads_again))
    fa2 = _varlen(q, k, v, cu, max(lengths), 0.125)
    fa2.backward(grad)
    fa2_grads = [x.grad for x in (q, k, v)]
    exact = [x.detach().float().requires_grad_() for x in (q, k, v)]
    want = rows_reference(*exact, lengths, 0.125)
    want.backward(grad.float())
    assert (out.float() - want).abs().max() <= 2 * (fa2.float() - want).abs().max() + 1e-3
    for ours, theirs, ref in zip(grads, fa2_grads, exact):
        assert (ours.float() - ref.grad).abs().max() <= 2 * (theirs.float() - ref.grad).abs().max() + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_a_register_cap_changes_no_bit(monkeypatch):
    """A blocking's register cap (`maxnreg`, spills allowed) changes where values live, not the arithmetic."""
    dev = torch.device("cuda")
    lengths = [700, 1024, 513]
    q, k, v, grad, cu = (x.to(dev) if i == 4 else x.detach().to(dev).requires_grad_(i < 3) for i, x in
                         enumerate(case(lengths, 14, 2, 64, torch.bfloat16, seed=3)))
    monkeypatch.setattr(flash_kernel, "KEYS", (64, 16, 4, 2))
    out, grads = run(q, k, v, grad, cu, max(lengths), 0.125)
    monkeypatch.setattr(flash_kernel, "KEYS", (64, 16, 4, 2, 128))
    out_capped, grads_capped = run(q, k, v, grad, cu, max(lengths), 0.125)
    assert torch.equal(out, out_capped) and all(torch.equal(a, b) for a, b in zip(grads, grads_capped))
