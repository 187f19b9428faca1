"""The optimizer's step with clipping: a fused AdamW takes the clip factor as its grad_scale (one pass over the
gradients fewer) and lands where clip_grad_norm_ and the same step land."""

import pytest
import torch

from turnrl.config.schema import OptimConfig
from turnrl.train.optim import build_optimizer, clip_and_step


def _pair(fused: bool, scale: float, seed: int = 0):
    """Two identical parameter sets with the same gradients (norm about `scale` times that of randn)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    values = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) * scale for s in shapes]
    out = []
    for _ in range(2):
        params = [torch.nn.Parameter(v.clone()) for v in values]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer = torch.optim.AdamW(params, lr=0.05, weight_decay=0.01, fused=fused or None)
        out.append((params, optimizer))
    return out


@pytest.mark.parametrize("scale,max_norm", [(10.0, 1.0), (0.01, 1.0), (10.0, 0.0)])
def test_a_fused_step_folds_the_clip_into_its_kernel_and_matches_clip_grad_norm(scale, max_norm):
    (ours, fused_opt), (ref, ref_opt) = _pair(True, scale)
    norm = clip_and_step(fused_opt, ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm if max_norm > 0 else float("inf"))
    ref_opt.step()
    torch.testing.assert_close(norm, expected)
    assert (norm > max_norm) == (scale == 10.0)   # the first and last cases clip (or would), the second does not
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
    assert not hasattr(fused_opt, "grad_scale")   # left as it was: a later GradScaler is not confused
    # and a second step (Adam's moments carry the clipped gradients) still agrees
    for a, b in zip(ours, ref):
        a.grad = b.grad = torch.full_like(a, 3.0)
    clip_and_step(fused_opt, ours, max_norm)
    torch.nn.utils.clip_grad_norm_(ref, max_norm if max_norm > 0 else float("inf"))
    ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)


def test_an_unfused_optimizer_gets_clip_grad_norm_bit_for_bit():
    (ours, opt), (ref, ref_opt) = _pair(False, 10.0)
    norm = clip_and_step(opt, ours, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    ref_opt.step()
    assert torch.equal(norm, expected)
    for a, b in zip(ours, ref):
        assert torch.equal(a.detach(), b.detach())


def test_an_optimizer_whose_grad_scale_is_taken_is_clipped_the_usual_way():
    (ours, opt), (ref, ref_opt) = _pair(True, 10.0)
    opt.grad_scale = ref_opt.grad_scale = torch.tensor(2.0)   # e.g. a GradScaler's, between its unscale and step
    clip_and_step(opt, ours, 1.0)
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    ref_opt.step()
    for a, b in zip(ours, ref):
        assert torch.equal(a.detach(), b.detach())
    assert torch.equal(opt.grad_scale, torch.tensor(2.0))


def test_build_optimizer_fuses_only_on_gpus():
    params = [torch.nn.Parameter(torch.zeros(3))]
    optimizer, _ = build_optimizer(params, OptimConfig(), total_steps=10)
    assert not optimizer.param_groups[0]["fused"]   # CPU tensors: the foreach path, clip_grad_norm_ in the step
