"""The fused SwiGLU MLP (`trainer.fused_mlp`): its Triton kernels against float64 and the unfused MLP on the CPU
through Triton's interpreter; which MLPs it takes; on a GPU against the compiled unfused MLP."""

import importlib.util

import pytest
import torch

from turnrl.bench.train import SHAPES
from turnrl.train import swiglu_kernel as sk

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton (its interpreter runs on the CPU)")
SMALL = (32, 32, 16, 4, 1)   # blockings the interpreter runs in seconds: rows, columns, depth, warps, stages


def unfused(x, wg, wu, wd):
    return torch.nn.functional.linear(torch.nn.functional.silu(x @ wg.t()) * (x @ wu.t()), wd)


def case(m, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    wg, wu = (torch.randn(n, k, generator=g) / k ** 0.5 for _ in range(2))
    wd = torch.randn(k, n, generator=g) / n ** 0.5
    dy = torch.randn(m, k, generator=g)
    return [t.to(dtype).requires_grad_() for t in (x, wg, wu, wd)], dy.to(dtype)


def outputs(fn, leaves, dy):
    for t in leaves:
        t.grad = None
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach().clone()] + [t.grad.clone() for t in leaves]


def error(got, want):
    return float((got.double() - want).abs().max() / want.abs().max())


@needs_triton
@pytest.mark.parametrize("blockings", [(SMALL, SMALL), ((32, 64, 16, 4, 1), (16, 32, 32, 4, 1)),
                                       ((32, 64, 16, 4, 1, 1), (16, 32, 32, 4, 1, 1))])   # tensor descriptors
def test_output_and_gradients_equal_the_unfused_mlp(interpreted, monkeypatch, blockings):
    """70 rows (a partial row block), float32: equal to float64 to float32's rounding; bf16: as close to float64
    as the unfused bf16 MLP is."""
    monkeypatch.setattr(sk, "GATE_UP", blockings[0])
    monkeypatch.setattr(sk, "DOWN_BACK", blockings[1])
    leaves, dy = case(70, 64, 128, torch.float32)
    want = outputs(unfused, [t.detach().double().requires_grad_() for t in leaves], dy.double())
    for got, ref in zip(outputs(sk.swiglu, leaves, dy), want):
        assert error(got, ref) < 1e-5
    leaves, dy = case(70, 64, 128, torch.bfloat16, seed=1)
    want = outputs(unfused, [t.detach().double().requires_grad_() for t in leaves], dy.double())
    fused, plain = outputs(sk.swiglu, leaves, dy), outputs(unfused, leaves, dy)
    for got, base, ref in zip(fused, plain, want):
        assert error(got, ref) < max(2 * error(base, ref), 2 ** -8)


@needs_triton
def test_the_epilogues_round_where_the_unfused_graph_rounds(interpreted, monkeypatch):
    """bf16: h is silu(g) * u of the kernel's own g and u, each step rounded to bf16 (eager torch's rounding), and
    dg, du are the SiLU backward of dh = dy wd rounded to bf16, within one bf16 step."""
    monkeypatch.setattr(sk, "GATE_UP", SMALL)
    monkeypatch.setattr(sk, "DOWN_BACK", SMALL)
    (x, wg, wu, wd), dy = case(45, 32, 64, torch.bfloat16, seed=2)
    x, wg, wu, wd = (t.detach() for t in (x, wg, wu, wd))
    g, u, h = sk.gate_up(x, wg, wu)
    assert error(g, x.double() @ wg.double().t()) < 2 ** -7 and error(u, x.double() @ wu.double().t()) < 2 ** -7
    want = torch.nn.functional.silu(g) * u
    assert (h != want).float().mean() < 0.01
    assert torch.allclose(h.float(), want.float(), rtol=2 ** -7, atol=0)
    dgu = sk.down_back(dy, wd, g, u)
    assert dgu.shape == (45, 128)
    dh = (dy.float() @ wd.float()).bfloat16()
    gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()
    dg, du = torch.autograd.grad(torch.nn.functional.silu(gr) * ur, (gr, ur), dh)
    for got, ref in ((dgu[:, :64], dg), (dgu[:, 64:], du)):
        assert torch.allclose(got.float(), ref.float(), rtol=2 ** -6, atol=1e-6)


@needs_triton
def test_frozen_weights_get_no_gradient_work(interpreted, monkeypatch):
    """Weights that do not require grad (LoRA on other layers) get None, the rest the same values as before."""
    monkeypatch.setattr(sk, "GATE_UP", SMALL)
    monkeypatch.setattr(sk, "DOWN_BACK", SMALL)
    leaves, dy = case(40, 32, 64, torch.float32, seed=4)
    full = outputs(sk.swiglu, leaves, dy)
    x, wg, wu, wd = leaves
    for w in (wg, wu, wd):
        w.requires_grad_(False)
        w.grad = None
    x.grad = None
    sk.swiglu(x, wg, wu, wd).backward(dy)
    assert torch.equal(x.grad, full[1]) and wg.grad is None and wu.grad is None and wd.grad is None


@needs_triton
def test_tensor_descriptors_move_the_same_tiles(interpreted, monkeypatch):
    """The TMA kernels (a sixth blocking entry 1) give the pointer kernels' bits, a partial row block included."""
    (x, wg, wu, wd), dy = case(70, 64, 128, torch.bfloat16, seed=3)
    x, wg, wu, wd = (t.detach() for t in (x, wg, wu, wd))
    results = []
    for tma in (0, 1):
        monkeypatch.setattr(sk, "GATE_UP", (32, 32, 16, 4, 1, tma))
        monkeypatch.setattr(sk, "DOWN_BACK", (32, 64, 32, 4, 1, tma))
        g, u, h = sk.gate_up(x, wg, wu)
        results.append((g, u, h, sk.down_back(dy, wd, g, u)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@needs_triton
def test_a_compiled_model_runs_its_mlps_fused(interpreted, monkeypatch):
    """use_fused_mlp on a bf16 Llama-shaped model, its layers under torch.compile (fullgraph): the custom ops run
    in the graph and the logits and gradients match the model's own MLPs within bf16 noise."""
    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.setattr(sk, "GATE_UP", SMALL)
    monkeypatch.setattr(sk, "DOWN_BACK", SMALL)
    monkeypatch.setattr(sk, "_INTERPRET", True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**SHAPES["tiny-shape"])).to(torch.bfloat16)
    ids = torch.randint(0, 1024, (1, 37))

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits.float()
        logits.logsumexp(-1).sum().backward()
        return logits.detach(), model.model.layers[0].mlp.gate_proj.weight.grad.float()

    want = run()
    assert sk.use_fused_mlp(model) == 2
    for layer in model.model.layers:
        layer.compile(backend="aot_eager", fullgraph=True)
    got = run()
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 0.05 * b.abs().max()
    assert not torch.equal(got[1], want[1])   # the fused kernels ran (their sums round differently)


def test_which_mlps_it_takes():
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**SHAPES["tiny-shape"]))
    mlp = model.model.layers[0].mlp
    assert sk.fusable(mlp)
    ids = torch.randint(0, 1024, (1, 9))
    want = model(input_ids=ids).logits
    assert sk.use_fused_mlp(model) == 2 and sk.use_fused_mlp(model) == 2   # once a module, however often called
    assert mlp.forward.__func__ is sk._fused_forward
    # float32 on a CPU: the fused kernels do not apply, the MLPs' own forward runs
    assert torch.equal(model(input_ids=ids).logits, want)
    mlp.act_fn = torch.nn.GELU()
    assert not sk.fusable(mlp)
    from peft import LoraConfig, get_peft_model
    lora = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.for_model(**SHAPES["tiny-shape"])),
                          LoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(ValueError, match="fused_mlp=false"):
        sk.use_fused_mlp(lora)


def test_blockings_that_do_not_divide_the_widths_are_refused(monkeypatch):
    monkeypatch.setattr(sk, "GATE_UP", (32, 48, 16, 4, 1))
    with pytest.raises(ValueError, match="multiples"):
        sk.gate_up(torch.zeros(4, 32), torch.zeros(64, 32), torch.zeros(64, 32))
    monkeypatch.setattr(sk, "DOWN_BACK", (32, 32, 16, 4))
    with pytest.raises(ValueError, match="warps, stages"):
        sk.down_back(torch.zeros(4, 32), torch.zeros(32, 64), torch.zeros(4, 64), torch.zeros(4, 64))
    monkeypatch.setattr(sk, "DOWN_BACK", (32, 32, 16, 4, 1, 1, 0))
    with pytest.raises(ValueError, match="tma"):
        sk.down_back(torch.zeros(4, 32), torch.zeros(32, 64), torch.zeros(4, 64), torch.zeros(4, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_it_is_as_close_to_float32_as_the_compiled_mlp():
    """Qwen2.5-0.5B's widths, 4,099 tokens, bf16: output and gradients as close to the float32 MLP as the
    compiled unfused MLP's (cuBLAS and inductor), and two runs give the same bits."""
    torch.manual_seed(0)
    leaves, dy = case(4099, 896, 4864, torch.float32)
    leaves = [t.detach().cuda().bfloat16().requires_grad_() for t in leaves]
    dy = dy.cuda().bfloat16()
    want = outputs(unfused, [t.detach().float().requires_grad_() for t in leaves], dy.float())
    want = [w.double() for w in want]
    fused = torch.compile(sk.swiglu, dynamic=True)
    plain = outputs(torch.compile(unfused, dynamic=True), leaves, dy)
    got = outputs(fused, leaves, dy)
    for a, b, ref in zip(got, plain, want):
        assert error(a, ref) < max(1.5 * error(b, ref), 2 ** -9)
    for a, b in zip(outputs(fused, leaves, dy), got):
        assert torch.equal(a, b)
    with pytest.MonkeyPatch.context() as patch:   # tensor descriptors (TMA): the same tiles, the same bits
        patch.setattr(sk, "GATE_UP", (*sk.GATE_UP[:5], 1))
        patch.setattr(sk, "DOWN_BACK", (*sk.DOWN_BACK[:5], 1))
        for a, b in zip(outputs(fused, leaves, dy), got):
            assert torch.equal(a, b)
