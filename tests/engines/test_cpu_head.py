"""The engine's CPU LM head: W @ x^T for a decode step's few rows, `linear` otherwise; the same parameters."""

import pytest
import torch

from turnrl.engines.cpu_head import SKINNY_ROWS, SkinnyHead, use_skinny_head
from turnrl.models import resolve


def heads(bias: bool, dtype=torch.float32):
    torch.manual_seed(0)
    plain = torch.nn.Linear(48, 300, bias=bias).to(dtype)
    skinny = torch.nn.Linear(48, 300, bias=bias).to(dtype)
    skinny.load_state_dict(plain.state_dict())
    skinny.__class__ = SkinnyHead
    return plain, skinny


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (SKINNY_ROWS, 1), (2, 4), (SKINNY_ROWS + 1, 1), (4, 7), (5,)])
def test_the_skinny_head_equals_linear_for_every_row_count(bias, shape):
    plain, skinny = heads(bias)
    x = torch.randn(*shape, 48)
    want, got = plain(x), skinny(x)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_other_dtypes_and_large_batches_take_linear_itself():
    plain, skinny = heads(False, torch.bfloat16)
    x = torch.randn(2, 1, 48, dtype=torch.bfloat16)
    assert torch.equal(skinny(x), plain(x))
    plain, skinny = heads(True)
    x = torch.randn(SKINNY_ROWS + 4, 48)
    assert torch.equal(skinny(x), plain(x))


def test_use_skinny_head_keeps_the_names_and_the_tied_weight():
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(resolve("tiny-random"), dtype=torch.float32)
    keys = list(model.state_dict())
    assert use_skinny_head(model) and type(model.get_output_embeddings()) is SkinnyHead
    assert list(model.state_dict()) == keys
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not use_skinny_head(model)          # already switched: nothing to do
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 3, model.config.vocab_size) and torch.isfinite(logits).all()
