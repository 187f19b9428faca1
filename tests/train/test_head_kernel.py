"""The fused head's Triton kernels (run here under Triton's CPU interpreter) against torch's softmax."""

import pytest
import torch

from turnrl.train import fused_head, head_kernel
from turnrl.train.fused_head import linear_logprobs


def reference(logits, labels, inv_temp):
    x = logits.double() * inv_temp
    logp = torch.log_softmax(x, -1)
    lp = logp.gather(1, labels[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, torch.logsumexp(x, -1), ent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stats_kernel_is_one_pass_of_log_softmax_over_several_blocks(interpreted, dtype, monkeypatch):
    monkeypatch.setattr(head_kernel, "BLOCK", 256)
    torch.manual_seed(0)
    # 1,000 entries: three full blocks and a partial one; rows whose maximum sits in a later block, and a peak
    logits = (torch.randn(6, 1000) * 4).to(dtype)
    logits[1, 900] = 40.0
    logits[2, :256] = -30.0
    labels = torch.tensor([0, 900, 999, 255, 256, 17])
    for inv_temp in (1.0, 1 / 0.7):
        lp, lse, ent = head_kernel.logit_stats(logits, labels, inv_temp)
        want_lp, want_lse, want_ent = reference(logits, labels, inv_temp)
        assert lp.dtype == lse.dtype == ent.dtype == torch.float32
        torch.testing.assert_close(lp.double(), want_lp, rtol=0, atol=2e-5)
        torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-5)
        torch.testing.assert_close(ent.double(), want_ent, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grad_kernel_writes_scaled_onehot_minus_softmax_in_place(interpreted, dtype, monkeypatch):
    monkeypatch.setattr(head_kernel, "BLOCK", 256)
    torch.manual_seed(1)
    logits = (torch.randn(5, 700) * 3).to(dtype)
    labels = torch.tensor([3, 699, 256, 0, 511])
    inv_temp = 1 / 1.3
    x = logits.double() * inv_temp
    lse = torch.logsumexp(x, -1)
    scale = torch.randn(5)
    want = (torch.nn.functional.one_hot(labels, 700).double() - torch.softmax(x, -1)) * scale.double()[:, None]
    out = head_kernel.logit_grad_(logits, labels, lse.float(), scale, inv_temp)
    assert out.data_ptr() == logits.data_ptr() and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.double(), want.to(dtype).double(), rtol=0, atol=tol)


def test_the_head_on_the_kernels_has_log_softmax_values_and_gradients(interpreted, monkeypatch):
    """`linear_logprobs` with CUDA's chunk functions (the kernels), here on the interpreter."""
    monkeypatch.setattr(head_kernel, "BLOCK", 64)
    monkeypatch.setitem(fused_head.KEEP_SOFTMAX_BYTES, "cpu", 0)   # CUDA never keeps the softmax
    monkeypatch.setattr(fused_head, "_kernels", lambda device: (fused_head._triton_forward,
                                                                fused_head._triton_backward))
    torch.manual_seed(2)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(150, 16, requires_grad=True)
    labels = torch.randint(0, 150, (2, 9))
    select = torch.rand(2, 9) > 0.3
    lp, ent = linear_logprobs(hidden, weight, labels, temperature=0.8, chunk=4, select=select)
    g = torch.randn(2, 9)
    (lp * g).sum().backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logp = torch.log_softmax((h2 @ w2.T) / 0.8, -1)
    want = logp.gather(-1, labels[..., None]).squeeze(-1) * select
    (want * g).sum().backward()
    torch.testing.assert_close(lp, want.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent[select], -(logp.exp() * logp).sum(-1).detach()[select], rtol=0, atol=1e-4)
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=0, atol=1e-5)


def test_the_kernels_refuse_what_they_cannot_take():
    with pytest.raises(ValueError, match="unit last stride"):
        head_kernel.logit_grad_(torch.zeros(4, 6).T, torch.zeros(6, dtype=torch.long), torch.zeros(6),
                                torch.zeros(6), 1.0)
    with pytest.raises(ValueError, match="do not keep"):
        fused_head._triton_forward(torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long), 1.0,
                                   True)
    assert not head_kernel.available(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and triton")
def test_gpu_head_kernels_match_the_compiled_chunk_bodies_at_the_real_vocabulary(monkeypatch):
    """Qwen2.5's vocabulary and width in bf16: the kernels against the compiled bodies they replaced."""
    torch.manual_seed(3)
    n, width, vocab = 700, 896, 151936
    hidden = (torch.randn(1, n, width, device="cuda") * 0.5).to(torch.bfloat16)
    weight = (torch.randn(vocab, width, device="cuda") * 0.05).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (1, n), device="cuda")
    g = torch.randn(1, n, device="cuda")
    results = {}
    for name, kernels in {"triton": (fused_head._triton_forward, fused_head._triton_backward),
                          "compiled": (torch.compile(fused_head._fused_forward, dynamic=True),
                                       torch.compile(fused_head._fused_backward, dynamic=True))}.items():
        monkeypatch.setitem(fused_head._KERNELS, "cuda", kernels)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = linear_logprobs(h, w, labels, temperature=0.9, chunk=256)
        (lp * g).sum().backward()
        results[name] = (lp, ent, h.grad.float(), w.grad.float())
    (lp, ent, gh, gw), (want_lp, want_ent, want_gh, want_gw) = results["triton"], results["compiled"]
    assert (lp - want_lp).abs().max().item() < 2e-3 and (ent - want_ent).abs().max().item() < 2e-3
    # d logits are rounded to bf16 in both: a sum in another order can round an entry the other way
    for got, want in ((gh, want_gh), (gw, want_gw)):
        assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item()
