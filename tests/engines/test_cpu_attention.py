"""The CPU decode attention gives the logits SDPA gives, for padded rows and grouped-query heads."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from turnrl.engines.cpu_attention import NAME, decode_attention, use_decode_attention
from turnrl.models import prepare


def decode_logits(model, steps=4):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 200, (3, 12), generator=gen)
    attn = torch.ones(3, 12, dtype=torch.long)
    attn[1, :5] = 0                                    # a left-padded row
    out = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0),
                past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    cache, logits = out.past_key_values, [out.logits[:, -1]]
    for _ in range(steps):
        tok = logits[-1].argmax(-1, keepdim=True)
        attn = torch.cat([attn, torch.ones(3, 1, dtype=torch.long)], 1)
        out = model(input_ids=tok, attention_mask=attn, position_ids=attn.sum(1, keepdim=True) - 1,
                    past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("name", ["tiny-random", "smollm2-135m-instruct"])
def test_decode_attention_matches_sdpa(name, request):
    path = prepare(name) if name == "tiny-random" else request.getfixturevalue("smollm2_dir")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    assert model.config.num_attention_heads != model.config.num_key_value_heads or name == "tiny-random"
    with torch.no_grad():
        expected = decode_logits(model)
        assert use_decode_attention(model) and model.config._attn_implementation == NAME
        got = decode_logits(model)
    assert (got - expected).abs().max().item() < 1e-4


def test_a_float_mask_is_added_and_prefill_goes_to_sdpa():
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.is_causal = 2, True    # what transformers' attention modules carry
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 1, 8, generator=gen), torch.randn(2, 2, 6, 8, generator=gen),
               torch.randn(2, 2, 6, 8, generator=gen))
    mask = torch.zeros(2, 1, 1, 6)
    mask[0, ..., :2] = torch.finfo(torch.float32).min
    out, _ = decode_attention(module, q, k, v, mask, scaling=0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           attn_mask=mask, scale=0.5)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-5)
    prefill, _ = decode_attention(module, torch.randn(2, 4, 3, 8, generator=gen), k, v, None, scaling=0.5)
    assert prefill.shape == (2, 3, 4, 8)


def test_models_not_on_sdpa_are_left_alone():
    model = AutoModelForCausalLM.from_pretrained(prepare("tiny-random"), attn_implementation="eager")
    assert not use_decode_attention(model) and model.config._attn_implementation == "eager"
