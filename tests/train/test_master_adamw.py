"""`trainer.optim.fused_master_step`: AdamW on the fp32 masters writing the bf16 weights in one Triton kernel, against
torch's AdamW and the masters' copy, on the CPU through Triton's interpreter; its fallbacks and its state."""

import copy
import importlib.util

import pytest
import torch

from turnrl.config import ConfigError, load_config
from turnrl.config.train import OptimConfig
from turnrl.train import master_adamw as ma
from turnrl.train.master import MasterWeights
from turnrl.train.optim import build_optimizer

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton (its interpreter runs on the CPU)")
SIZES = [(40, 64), (5000,), (7,), (3, 1000)]   # several chunks of 2048, partial ones, a tensor smaller than a block


def model():
    torch.manual_seed(0)
    return torch.nn.ParameterList([torch.nn.Parameter(torch.randn(*size)) for size in SIZES])


def grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(*size, generator=g) * (1 + step) for size in SIZES]


def run(optimizer_kind, steps=3, scales=(None, 2.5, None), lrs=(1e-2, 5e-3, 2e-2)):
    """(masters, moments, weights) after `steps` steps of the masters of `model()` in bf16 weights."""
    net = model()
    master = MasterWeights([net])
    kwargs = dict(lr=lrs[0], betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    optimizer = optimizer_kind(master.masters, **kwargs)
    master.attach(optimizer)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lrs[step]
        for m, g in zip(master.masters, grads(step)):
            m.grad = g.clone()
        scale = scales[step]
        if optimizer_kind is torch.optim.AdamW:   # the reference: the clip factor divides the gradients first
            if scale is not None:
                for m in master.masters:
                    m.grad /= scale
        elif scale is not None:
            optimizer.grad_scale = torch.tensor(scale)
        optimizer.step()
        optimizer.__dict__.pop("grad_scale", None)
    states = [optimizer.state[m] for m in master.masters]
    return ([m.detach().clone() for m in master.masters], [s["exp_avg"].clone() for s in states],
            [s["exp_avg_sq"].clone() for s in states], [float(s["step"]) for s in states],
            [w.detach().clone() for w in master.weights], optimizer)


@needs_triton
def test_the_kernel_steps_as_torch_adamw_and_writes_the_weights(interpreted, monkeypatch):
    """Three steps (weight decay, a clip factor on one, the learning rate changed between them), tensors over
    several chunks: masters and moments equal torch's AdamW to float32 rounding (a few units in the last place),
    the step counts equal, and the bf16 weights are the masters rounded to nearest (what the masters' copy
    writes)."""
    monkeypatch.setattr(ma, "_INTERPRET", True)
    monkeypatch.setattr(ma, "CHUNK", 2048)
    monkeypatch.setattr(ma, "BLOCK", 256)
    calls = []
    kernel = ma._kernel()
    monkeypatch.setattr(ma, "_kernel", lambda: calls.append(1) or kernel)
    got = run(ma.MasterAdamW)
    want = run(torch.optim.AdamW)
    assert len(calls) == 3
    for name, a, b in zip(("masters", "exp_avg", "exp_avg_sq"), got[:3], want[:3]):
        for x, y in zip(a, b):
            assert torch.allclose(x, y, rtol=2e-6, atol=2e-6), name
    assert got[3] == want[3] == [3.0] * len(SIZES)
    for w, m in zip(got[4], got[0]):
        assert w.dtype == torch.bfloat16 and torch.equal(w, m.bfloat16())


def test_where_the_kernel_cannot_run_torch_steps_and_the_weights_follow():
    """CPU tensors (no interpreter) or a closure: torch's AdamW step, then the masters' copy into the weights."""
    got = run(ma.MasterAdamW, scales=(None,) * 3)   # torch's unfused AdamW takes no clip factor (clip_and_step
    want = run(torch.optim.AdamW, scales=(None,) * 3)   # scales its gradients instead)
    for a, b in zip(got[:3], want[:3]):
        for x, y in zip(a, b):
            assert torch.allclose(x, y, rtol=1e-6, atol=1e-9)
    for w, m in zip(got[4], got[0]):
        assert torch.equal(w, m.bfloat16())
    optimizer = got[5]
    masters = [p for group in optimizer.param_groups for p in group["params"]]
    for m, g in zip(masters, grads(5)):
        m.grad = g
    optimizer.step(lambda: torch.tensor(1.0))
    assert all(float(optimizer.state[m]["step"]) == 4.0 for m in masters)


@needs_triton
def test_a_gradient_off_the_16_byte_grid_takes_torchs_step(interpreted, monkeypatch):
    """The kernel reads 16 bytes at a time: a gradient that starts 4 bytes into its storage leaves the step to
    torch (and the masters' copy), with the same result."""
    monkeypatch.setattr(ma, "_INTERPRET", True)
    calls = []
    kernel = ma._kernel()
    monkeypatch.setattr(ma, "_kernel", lambda: calls.append(1) or kernel)
    net = model()
    master = MasterWeights([net])
    optimizer = ma.MasterAdamW(master.masters, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    master.attach(optimizer)
    for m, g in zip(master.masters, grads(0)):
        m.grad = torch.cat([torch.zeros(1), g.flatten()])[1:].view_as(g)
    optimizer.step()
    assert not calls and all(torch.equal(w, m.bfloat16()) for w, m in zip(master.weights, master.masters))
    reference = run(torch.optim.AdamW, steps=1, scales=(None,))
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(master.masters, reference[0]))


@needs_triton
def test_its_state_loads_into_torch_adamw_and_back(interpreted, monkeypatch):
    """The state after fused steps is torch's: a torch AdamW loaded from it takes the next step as the fused one
    does."""
    monkeypatch.setattr(ma, "_INTERPRET", True)
    monkeypatch.setattr(ma, "CHUNK", 2048)
    monkeypatch.setattr(ma, "BLOCK", 256)
    *_, fused = run(ma.MasterAdamW, steps=2)
    state = fused.state_dict()   # its tensors are the optimizer's own: each load takes a copy, as from a file
    masters = [p for group in fused.param_groups for p in group["params"]]
    plain = torch.optim.AdamW([torch.nn.Parameter(m.detach().clone()) for m in masters], lr=1.0)
    plain.load_state_dict(copy.deepcopy(state))
    again = ma.MasterAdamW([torch.nn.Parameter(m.detach().clone()) for m in masters], lr=1.0)
    again.load_state_dict(copy.deepcopy(state))
    again.write_weights_of(again.param_groups[0]["params"],
                           [torch.nn.Parameter(m.detach().bfloat16()) for m in masters], lambda: None)
    for optimizer in (plain, again):
        for p, g in zip(optimizer.param_groups[0]["params"], grads(7)):
            p.grad = g.clone()
        optimizer.step()
    for a, b in zip(plain.param_groups[0]["params"], again.param_groups[0]["params"]):
        assert torch.allclose(a, b, rtol=2e-6, atol=2e-6)


def test_the_config_key_picks_it_on_gpus_only():
    """auto (the default): torch's AdamW and the copy hook on CPU parameters; on: an error there, and with fp32
    weights (no masters), and with the Ray ranks (which keep FSDP2's masters)."""
    assert load_config(None, []).trainer.optim.fused_master_step == "auto"
    assert load_config(None, ["trainer.optim.fused_master_step=true"]).trainer.optim.fused_master_step == "on"
    with pytest.raises(ConfigError, match="fused_master_step: on"):
        load_config(None, ["trainer.optim.fused_master_step=on", "trainer.placement=split"])
    net = model()
    master = MasterWeights([net])
    optimizer, _ = build_optimizer(master.masters, OptimConfig(), 10, master)
    assert type(optimizer) is torch.optim.AdamW   # CPU parameters: torch's, with the copy hook
    for m, g in zip(master.masters, grads(0)):
        m.grad = g
    optimizer.step()
    assert all(torch.equal(w, m.bfloat16()) for w, m in zip(master.weights, master.masters))
    with pytest.raises(ValueError, match="parameters are not on a GPU: set it to auto"):
        build_optimizer(master.masters, OptimConfig(fused_master_step="on"), 10, master)
    with pytest.raises(ValueError, match="the weights are fp32: set it to auto"):
        build_optimizer(list(model().parameters()), OptimConfig(fused_master_step="on"), 10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_it_steps_as_torch_fused_adamw():
    """On CUDA, through `build_optimizer` and `clip_and_step` (clipping active): masters and moments as torch's
    fused AdamW's to float32 rounding, the weights the masters rounded."""
    from turnrl.train.optim import clip_and_step

    def go(fused_master_step):
        torch.manual_seed(0)
        net = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(*s, device="cuda"))
                                      for s in [(4864, 896), (896,), (151936, 64), (3,)]])
        master = MasterWeights([net])
        optimizer, _ = build_optimizer(master.masters, OptimConfig(lr=1e-3, weight_decay=0.1,
                                                                   fused_master_step=fused_master_step), 10, master)
        assert (type(optimizer) is ma.MasterAdamW) == (fused_master_step == "auto")
        for step in range(3):
            g = torch.Generator(device="cuda").manual_seed(step)
            for m in master.masters:
                m.grad = torch.randn(m.shape, device="cuda", generator=g) * 10
            clip_and_step(optimizer, master.masters, 1.0)
        return master, optimizer

    (m1, o1), (m2, o2) = go("auto"), go("off")
    for a, b in zip(m1.masters, m2.masters):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(o1.state[a][key], o2.state[b][key], rtol=1e-5, atol=1e-9)
    for w, m in zip(m1.weights, m1.masters):
        assert torch.equal(w, m.bfloat16())
