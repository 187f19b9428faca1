"""The engine's CPU LM head: 7-15 rows padded to 16, `linear` itself otherwise; the same parameters."""

import pytest
import torch

from turnrl.engines.cpu_head import PAD_FROM, PAD_TO, PaddedHead, use_cpu_head
from turnrl.models import resolve


def heads(bias: bool, dtype=torch.float32):
    torch.manual_seed(0)
    plain = torch.nn.Linear(48, 300, bias=bias).to(dtype)
    padded = torch.nn.Linear(48, 300, bias=bias).to(dtype)
    padded.load_state_dict(plain.state_dict())
    padded.__class__ = PaddedHead
    return plain, padded


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(PAD_FROM, 1), (PAD_FROM,), (PAD_TO - 1, 1), (3, 4), (5, 2), (9,)])
def test_the_padded_head_equals_linear_on_the_real_rows(bias, shape):
    plain, padded = heads(bias)
    x = torch.randn(*shape, 48)
    want, got = plain(x), padded(x)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, PAD_FROM - 1, PAD_TO, PAD_TO + 3])
def test_row_counts_outside_the_window_and_other_dtypes_take_linear_itself(rows):
    plain, padded = heads(True)
    x = torch.randn(rows, 1, 48)
    assert torch.equal(padded(x), plain(x))
    plain, padded = heads(False, torch.bfloat16)
    x = torch.randn(PAD_FROM + 1, 48, dtype=torch.bfloat16)
    assert torch.equal(padded(x), plain(x))


def test_use_cpu_head_keeps_the_names_and_the_tied_weight():
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(resolve("tiny-random"), dtype=torch.float32)
    keys = list(model.state_dict())
    assert use_cpu_head(model) and type(model.get_output_embeddings()) is PaddedHead
    assert list(model.state_dict()) == keys
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not use_cpu_head(model)          # already switched: nothing to do
    ids = torch.tensor([[1, 2, 3]] * 8)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (8, 3, model.config.vocab_size) and torch.isfinite(logits).all()
