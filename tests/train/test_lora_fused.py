"""Fused LoRA linears compute what peft's forward computes (outputs and every gradient), and hand every case
they do not fuse back to peft."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear

from turnrl.models import prepare
from turnrl.train.lora_fused import FusedLoraLinear, fuse_lora_linears
from turnrl.train.policy import load_policy


def _plain(model):
    for module in model.modules():
        if type(module) is FusedLoraLinear:
            module.__class__ = Linear


def _run(model, ids, fused):
    (fuse_lora_linears if fused else _plain)(model)
    model.zero_grad()
    logits = model(input_ids=ids).logits
    (logits.float().square().mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _trained(model):
    """B starts at zero in peft: give the adapters weights so the LoRA branch is not a no-op."""
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def test_load_policy_fuses_every_lora_linear_and_keeps_the_model_s_outputs_and_gradients():
    model = _trained(load_policy(str(prepare("tiny-random")), torch.device("cpu"), lora_rank=4))
    assert sum(type(m) is FusedLoraLinear for m in model.modules()) > 0
    assert not any(type(m) is Linear for m in model.modules())
    ids = torch.randint(0, 49000, (2, 17))
    (want, want_g), (got, got_g) = _run(model, ids, False), _run(model, ids, True)
    assert torch.allclose(got, want, atol=1e-5)
    assert want_g.keys() == got_g.keys() and any("lora_A" in n for n in got_g)
    for name in want_g:
        assert torch.allclose(got_g[name], want_g[name], atol=1e-6, rtol=1e-4), name


def test_an_adapter_switched_off_or_merged_runs_peft_s_forward():
    model = _trained(load_policy(str(prepare("tiny-random")), torch.device("cpu"), lora_rank=4)).eval()
    ids = torch.randint(0, 49000, (1, 9))
    with torch.no_grad():
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        adapted = model(input_ids=ids).logits
        model.merge_adapter()
        merged = model(input_ids=ids).logits
        model.unmerge_adapter()
    assert not torch.allclose(base, adapted, atol=1e-4)   # the adapter changes the outputs...
    assert torch.allclose(merged, adapted, atol=1e-4)     # ...and merged weights give the same ones


@pytest.mark.parametrize("case", ["dora", "two adapters"])
def test_cases_it_does_not_fuse_equal_peft(case):
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(str(prepare("tiny-random")), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", use_dora=case == "dora"))
    if case == "two adapters":
        model.add_adapter("second", LoraConfig(r=2, target_modules="all-linear"))
        model.base_model.set_adapter(["default", "second"])
    _trained(model)
    ids = torch.randint(0, 49000, (2, 11))
    (want, want_g), (got, got_g) = _run(model, ids, False), _run(model, ids, True)
    module = next(m for m in model.modules() if type(m) is FusedLoraLinear)
    assert module._plain_adapter(ids, (), {}) is None
    assert torch.equal(got, want)
    for name in want_g:
        assert torch.equal(got_g[name], want_g[name]), name
