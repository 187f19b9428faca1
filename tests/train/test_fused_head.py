"""The chunked fused logprob head equals the plain logits path: values, entropy and gradients."""

import pytest
import torch

from turnrl.models import prepare
from turnrl.train import fused_head
from turnrl.train.fused_head import linear_logprobs
from turnrl.train.policy import forward_logprobs, load_policy


@pytest.fixture(params=["kept", "recomputed", "pure-recomputed", "pure-kept"])
def softmax(request, monkeypatch):
    """Both backward paths: the softmax kept from the forward (CPU default) and recomputed (GPUs); each with
    the in-place chunk bodies (CPUs) and the pure ones that CUDA compiles (run eagerly here)."""
    if request.param.endswith("recomputed"):
        monkeypatch.setitem(fused_head.KEEP_SOFTMAX_BYTES, "cpu", 0)
    if request.param.startswith("pure"):
        monkeypatch.setattr(fused_head, "_kernels", lambda device: (fused_head._fused_forward,
                                                                    fused_head._fused_backward))
    return request.param


def test_linear_logprobs_matches_log_softmax_with_selection_and_temperature(softmax):
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (2, 7))
    select = torch.tensor([[0, 1, 1, 0, 1, 1, 1], [1, 0, 0, 0, 1, 1, 0]], dtype=torch.bool)
    lp, ent = linear_logprobs(hidden, weight, labels, temperature=0.7, chunk=3, select=select)
    logits = hidden @ weight.T / 0.7
    want = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1) * select
    want_ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1) * select
    assert torch.allclose(lp.double(), want, atol=1e-5)
    assert torch.allclose(ent.double(), want_ent, atol=1e-4)
    assert (lp[~select] == 0).all()
    g = torch.randn(2, 7, dtype=torch.float64)
    gh, gw = torch.autograd.grad((lp.double() * g).sum(), (hidden, weight))
    wh, ww = torch.autograd.grad((want * g).sum(), (hidden, weight))
    assert torch.allclose(gh, wh, atol=1e-4) and torch.allclose(gw, ww, atol=1e-4)


def test_a_known_count_of_selected_positions_gives_the_same_bits_and_gradients():
    torch.manual_seed(1)
    hidden = torch.randn(3, 9, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    labels = torch.randint(0, 40, (3, 9))
    select = torch.rand(3, 9) > 0.5
    g = torch.randn(3, 9)
    out = []
    for selected in (None, int(select.sum())):   # boolean index, then positions from the host's count
        lp, ent = linear_logprobs(hidden, weight, labels, chunk=4, select=select, selected=selected)
        out.append((lp, ent, torch.autograd.grad((lp * g).sum(), (hidden, weight))))
    (lp0, ent0, (gh0, gw0)), (lp1, ent1, (gh1, gw1)) = out
    assert torch.equal(lp0, lp1) and torch.equal(ent0, ent1) and torch.equal(gh0, gh1) and torch.equal(gw0, gw1)
    with pytest.raises(ValueError, match="selected=3 but select has"):
        linear_logprobs(hidden, weight, labels, select=select, selected=3)


@pytest.mark.parametrize("lora", [0, 4])
def test_forward_logprobs_fused_equals_unfused_on_a_model(lora):
    model = load_policy(str(prepare("tiny-random")), torch.device("cpu"), lora_rank=lora)
    torch.manual_seed(1)
    ids = torch.randint(0, 49000, (2, 24))
    attn, pos = torch.ones_like(ids), torch.arange(24).expand(2, 24)
    select = torch.zeros(2, 24, dtype=torch.bool)
    select[:, 8:20] = True
    weights = torch.rand(2, 24)
    out = []
    for fused in (False, True):
        model.zero_grad()
        lp, ent = forward_logprobs(model, ids, attn, pos, 0.9, None, with_entropy=True, fused_head=fused,
                                   select=select)
        (lp * weights * select).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((lp * select, ent * select, grads))
    (lp0, e0, g0), (lp1, e1, g1) = out
    assert torch.allclose(lp0, lp1, atol=1e-5) and torch.allclose(e0, e1, atol=1e-4)
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        assert torch.allclose(g0[name], g1[name], atol=1e-5, rtol=1e-4), name


def test_a_frozen_head_gets_no_weight_gradient_and_the_same_hidden_gradient(softmax):
    torch.manual_seed(2)
    hidden = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, dtype=torch.float64)
    labels = torch.randint(0, 40, (1, 9))
    g = torch.randn(1, 9, dtype=torch.float64)
    lp, _ = linear_logprobs(hidden[None], weight, labels, chunk=4)
    (lp.double() * g).sum().backward()
    want = torch.autograd.grad((torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels[0, :, None]).squeeze(-1)
                                * g[0]).sum(), hidden)[0]
    assert weight.grad is None
    assert torch.allclose(hidden.grad, want, atol=1e-6)


def test_the_softmax_is_kept_only_for_a_backward_and_within_the_budget(monkeypatch):
    kept = []
    forward = fused_head._chunk_forward
    monkeypatch.setattr(fused_head, "_chunk_forward", lambda *a: kept.append(a[-1]) or forward(*a))
    hidden = torch.randn(1, 6, 8, requires_grad=True)
    weight, labels = torch.randn(30, 8), torch.randint(0, 30, (1, 6))
    with torch.no_grad():
        linear_logprobs(hidden, weight, labels)
    linear_logprobs(hidden, weight, labels)
    monkeypatch.setitem(fused_head.KEEP_SOFTMAX_BYTES, "cpu", 6 * 30 * 4 - 1)
    linear_logprobs(hidden, weight, labels)
    assert kept == [False, True, False]


def test_add_weight_grad_sums_the_chunks_products_in_float32():
    torch.manual_seed(3)
    chunks = [(torch.randn(5, 30, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)) for _ in range(3)]
    acc = None
    for dlogits, h in chunks:
        acc = fused_head.add_weight_grad(acc, dlogits, h)
    want = sum(d.T @ h for d, h in chunks)
    assert acc.dtype == torch.float32 and torch.allclose(acc.double(), want, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_add_weight_grad_on_cuda_keeps_the_bf16_products_in_float32():
    torch.manual_seed(4)
    chunks = [((torch.randn(256, 4096, device="cuda") * 1e-3).bfloat16(),
               torch.randn(256, 896, device="cuda").bfloat16()) for _ in range(3)]
    acc = None
    for dlogits, h in chunks:
        acc = fused_head.add_weight_grad(acc, dlogits, h)
    want = sum(d.T.double() @ h.double() for d, h in chunks)
    assert acc.dtype == torch.float32
    # float32 sums of exact bf16 products: errors near float32's rounding, where a bf16 product per chunk (the
    # old path) would be off by about 2^-9 of its largest entries
    assert (acc.double() - want).abs().max().item() < 1e-5 * want.abs().max().item()
