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


@pytest.fixture
def kv_copies(monkeypatch):
    """The group sizes of every `repeat_kv` call transformers' SDPA path makes (its KV copies per query head)."""
    import transformers.integrations.sdpa_attention as hf_sdpa

    copies = []
    original = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda x, n: copies.append(n) or original(x, n))
    return copies


def grouped_case(seed=2):
    module = torch.nn.Module().train()
    module.num_key_value_groups, module.is_causal = 3, True
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 6, 5, 8, generator=gen).requires_grad_()
    k, v = (torch.randn(2, 2, 9, 8, generator=gen).requires_grad_() for _ in range(2))
    mask = torch.ones(2, 1, 5, 9, dtype=torch.bool).tril(4)     # the suffix's causal part after 4 prefix keys
    mask[1, ..., :3] = False                                    # a padded prefix
    return module, q, k, v, mask


def test_masked_grouped_attention_keeps_the_kv_heads_shared(kv_copies):
    import transformers.integrations.sdpa_attention as hf_sdpa
    from turnrl.engines.cpu_attention import masked_sdpa

    copies = kv_copies
    results = []
    for attention in (hf_sdpa.sdpa_attention_forward, masked_sdpa):
        module, q, k, v, mask = grouped_case()
        out, _ = attention(module, q, k, v, mask, scaling=0.3)
        out.pow(2).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    assert copies == [3, 3]                        # transformers copied keys and values; masked_sdpa did not
    (ref, *ref_grads), (got, *grads) = results
    assert torch.equal(got, ref)                   # the same kernel on the same numbers: bit for bit
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-5)     # the grouped heads' gradients summed in another order


def test_masked_sdpa_hands_other_calls_to_transformers(kv_copies):
    from turnrl.engines.cpu_attention import masked_sdpa

    module, q, k, v, mask = grouped_case()
    copies = kv_copies
    with torch.no_grad():
        half, _ = masked_sdpa(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, scaling=0.3)   # bf16: theirs
    assert half.dtype == torch.bfloat16 and copies == [3, 3]
    with torch.no_grad():
        unmasked, _ = masked_sdpa(module, q, k, v, None, scaling=0.3)      # causal, no mask: transformers' path
        ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                               is_causal=True, scale=0.3)
    assert torch.allclose(unmasked, ref.transpose(1, 2), atol=1e-6)


def test_a_cpu_training_model_runs_masked_sdpa_with_the_same_logits_and_close_gradients(smollm2_dir, kv_copies):
    from turnrl.engines.cpu_attention import MASKED_NAME
    from turnrl.train.policy import load_policy

    copies = kv_copies
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 2000, (2, 10), generator=gen)
    attn = torch.ones(2, 10, dtype=torch.long)
    attn[1, 7:] = 0                                                   # a right-padded row: a real mask
    outs = []
    for switch in (False, True):
        model = load_policy(str(smollm2_dir), torch.device("cpu"))
        if not switch:
            model.set_attn_implementation("sdpa")
        assert (model.config._attn_implementation == MASKED_NAME) == switch
        logits = model(input_ids=ids, attention_mask=attn).logits
        (logits[attn.bool()].logsumexp(-1).sum()).backward()
        grad = model.model.layers[0].self_attn.k_proj.weight.grad
        outs.append((logits.detach(), grad, len(copies)))
        copies.clear()
    assert outs[0][2] == 2 * model.config.num_hidden_layers and outs[1][2] == 0   # masked: no KV copies
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.allclose(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-5)
