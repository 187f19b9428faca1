"""bf16 weights with fp32 master weights: what is cast, how gradients add up, the update, checkpoints."""

import copy
import dataclasses

import pytest
import torch

from turnrl.bench.train import model_directory, synthetic_rows
from turnrl.config import ConfigError, load_config
from turnrl.train.master import MasterWeights, cast_weights, master_weights, resolve_param_dtype
from turnrl.train.optim import build_optimizer
from turnrl.train.policy import forward_logprobs, load_policy, trainable_parameters
from turnrl.train.update import UpdateSettings, policy_update

CPU = torch.device("cpu")
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    with model_directory("tiny-shape") as path:
        return load_policy(str(path), CPU)


@pytest.fixture(scope="module")
def rows():
    return synthetic_rows(6, 48, 1024, CPU, seed=2, group=3)


def test_float_weights_turn_bf16_with_exact_fp32_masters_and_buffers_and_ties_stay(base):
    model = copy.deepcopy(base)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.dtype for n, b in model.named_buffers()}
    master = MasterWeights([model])
    assert all(p.dtype == BF16 for p in model.parameters())
    assert {n: b.dtype for n, b in model.named_buffers()} == buffers   # rotary frequencies stay fp32
    assert model.lm_head.weight is model.model.embed_tokens.weight     # the tie holds
    assert len(master.masters) == len({id(p) for p in model.parameters()})
    for (name, p), m in zip(model.named_parameters(), master.masters):
        assert m.dtype == torch.float32 and torch.equal(m, before[name])   # masters: the fp32 values, exactly
        assert torch.equal(p, before[name].to(BF16))


def test_micro_batch_gradients_add_up_in_fp32_on_the_masters(base, rows):
    """The first backward's bf16 gradients become the masters' fp32 gradients when it ends (one multi-tensor
    cast), the next one's add into them, and the bf16 ones are freed: two micro-batches give the fp32 sum of
    the two bf16 gradients a plain bf16 model computes."""
    plain = copy.deepcopy(base)
    cast_weights(plain, BF16)
    model = copy.deepcopy(base)
    master = MasterWeights([model])
    halves = (slice(0, 3), slice(3, 6))

    def backward(m, part):
        lp, _ = forward_logprobs(m, rows.input_ids[part], rows.attention_mask[part], rows.position_ids[part],
                                 amp=BF16)
        (lp.float() * rows.loss_mask[part]).sum().backward()

    expected = None
    for part in halves:
        plain.zero_grad(set_to_none=True)
        backward(plain, part)
        grads = [p.grad.float() for p in plain.parameters()]
        expected = grads if expected is None else [a + b for a, b in zip(expected, grads)]
    backward(model, halves[0])
    assert not master._held                                   # cast when the backward ended
    for m, p in zip(master.masters, plain.parameters()):
        assert m.grad.dtype == torch.float32 and m.grad.shape == p.shape
    backward(model, halves[1])
    assert all(p.grad is None for p in model.parameters())   # the bf16 gradients are freed
    for m, want in zip(master.masters, expected):
        assert m.grad.dtype == torch.float32
        torch.testing.assert_close(m.grad, want, rtol=0, atol=0)


def test_a_backward_that_raises_leaves_nothing_held_for_the_next():
    """A backward that fails after some gradients were held (its end never comes, so they were never cast):
    the next backward starts clean and its gradients alone reach the masters."""
    class Fail(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("the backward fails here")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    master = MasterWeights([model])
    x = torch.randn(3, 4, dtype=BF16)
    with pytest.raises(RuntimeError, match="fails here"):
        model[1](Fail.apply(model[0](x))).sum().backward()     # the last layer's gradients come first: held
    assert master._held and all(m.grad is None for m in master.masters)
    model(x).sum().backward()
    plain = copy.deepcopy(model)
    for p, m in zip(plain.parameters(), master.masters):
        p.data = m.data.to(BF16)
    plain(x).sum().backward()
    assert not master._held
    for p, m in zip(plain.parameters(), master.masters):
        assert torch.equal(m.grad, p.grad.float())


GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", GPU])
def test_an_update_steps_the_masters_and_rounds_them_into_the_weights(base, rows, device):
    """The optimizer steps the fp32 masters; the weights are the masters rounded to bf16 after each step.
    Against fp32 weights under the same bf16 autocast, the update agrees to bf16 accuracy. (On a GPU the
    optimizer is fused AdamW and the copies into the weights are foreach kernels.)"""
    results = []
    rows = rows.to(torch.device(device))
    for with_masters in (False, True):
        model = copy.deepcopy(base).to(device)
        master = MasterWeights([model]) if with_masters else None
        params = master.masters if master else trainable_parameters(model)
        optimizer, scheduler = build_optimizer(params, load_config(None, ["trainer.optim.lr=1e-3"]).trainer.optim, 4,
                                               master)
        batch = dataclasses.replace(rows, old_logprobs=rows.old_logprobs.clone())
        settings = UpdateSettings(micro_batch_tokens=100, mini_batches=2)
        stats = policy_update(model, optimizer, scheduler, batch, settings, BF16, torch.Generator().manual_seed(0),
                              params)
        results.append((stats, [p.detach().clone() for p in params], model))
    (fp32_stats, fp32_params, _), (stats, masters, model) = results
    for m, w in zip(masters, model.parameters()):
        assert torch.equal(w, m.to(BF16))
    moved = [(m.cpu() - p0).abs().max() for m, p0 in zip(masters, base.parameters())]
    assert max(moved) > 1e-4                                                  # two steps moved the masters
    for key in ("loss/policy", "grad_norm"):
        assert stats[key] == pytest.approx(fp32_stats[key], rel=0.05, abs=1e-3), key
    for a, b in zip(masters, fp32_params):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)   # lr 1e-3: steps agree to within bf16 noise


def test_the_optimizer_must_step_the_masters(base):
    model = copy.deepcopy(base)
    master = MasterWeights([model])
    optimizer, _ = build_optimizer(trainable_parameters(model), load_config(None, []).trainer.optim, 1)
    with pytest.raises(ValueError, match="master weights"):
        master.attach(optimizer)


def test_master_state_round_trips_exactly_and_an_fp32_checkpoint_warns(base):
    a = copy.deepcopy(base)
    first = MasterWeights([a])
    with torch.no_grad():
        for m in first.masters:
            m.add_(1e-5)                     # below bf16's resolution near most weights: lost if rounded
    state = first.state_dict()
    b = copy.deepcopy(base)
    second = MasterWeights([b])
    second.load_state_dict(state)
    for x, y, w in zip(first.masters, second.masters, b.parameters()):
        assert torch.equal(x, y) and torch.equal(w, y.to(BF16))
    with pytest.raises(ValueError, match="do not fit"):
        second.load_state_dict({"masters": state["masters"][:-1]})
    with pytest.warns(UserWarning, match="no fp32 master weights"):
        second.resume(None)
    assert all(torch.equal(m, w.float()) for m, w in zip(second.masters, b.parameters()))


def test_param_dtype_bf16_where_asked_or_auto_on_cuda_and_refused_where_it_cannot_hold():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for asked in ("auto", "float32"):
        assert resolve_param_dtype(asked, BF16) == torch.float32
        assert resolve_param_dtype(asked, BF16, device=cpu) == torch.float32   # CPUs keep fp32 weights
    assert resolve_param_dtype("auto", BF16, device=cuda) == BF16              # GPUs: bf16 + fp32 masters
    assert resolve_param_dtype("auto", None, device=cuda) == torch.float32     # fp32 compute keeps fp32 weights
    assert resolve_param_dtype("float32", BF16, device=cuda) == torch.float32
    assert resolve_param_dtype("bfloat16", BF16) == BF16
    with pytest.raises(ValueError, match="trainer.dtype=bfloat16"):
        resolve_param_dtype("bfloat16", None)
    with pytest.raises(ValueError, match="engine.exact"):
        resolve_param_dtype("bfloat16", BF16, exact=torch.float32)
    assert resolve_param_dtype("auto", BF16, exact=torch.float32, device=cuda) == torch.float32
    assert master_weights([torch.nn.Linear(2, 2)], "auto", BF16) is None


def test_a_frozen_reference_is_cast_without_masters(base):
    model, reference = copy.deepcopy(base), copy.deepcopy(base).requires_grad_(False)
    master = master_weights([model], "bfloat16", BF16, frozen=[reference])
    assert master is not None and all(p.dtype == BF16 for p in reference.parameters())
    assert len(master.masters) == len(trainable_parameters(model))


def test_config_refuses_bf16_weights_without_bf16_compute():
    with pytest.raises(ConfigError, match="param_dtype"):
        load_config(None, ["trainer.param_dtype=bfloat16", "trainer.dtype=float32"])
    with pytest.raises(ConfigError):
        load_config(None, ["trainer.param_dtype=float16"])
