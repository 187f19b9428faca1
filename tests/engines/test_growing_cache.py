"""The engine's KV cache layer that appends in place: the same keys and values as transformers' own, fewer copies."""

import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer

from turnrl.engines.growing_cache import MIN_ROOM, GrowingLayer, grow_in_place
from turnrl.models import resolve


def layers():
    plain, growing = DynamicLayer(), DynamicLayer()
    growing.__class__ = GrowingLayer
    return plain, growing


def kv(rows=3, length=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, length, 4, generator=g), torch.randn(rows, 2, length, 4, generator=g)


def test_appends_equal_concatenation_and_reuse_one_buffer_until_it_is_full():
    plain, growing = layers()
    plain.update(*kv(length=5)), growing.update(*kv(length=5))
    buffer = growing.keys.data_ptr()
    for step in range(MIN_ROOM + 10):
        k, v = kv(seed=step + 1)
        want, got = plain.update(k, v), growing.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        if step < MIN_ROOM - 1:
            assert growing.keys.data_ptr() == buffer   # written in place: no new tensor
    assert growing.keys.data_ptr() != buffer            # the room ran out once: it grew, contents kept
    assert growing.get_seq_length() == plain.get_seq_length() == 5 + MIN_ROOM + 10


def test_tensors_set_from_outside_are_adopted_with_their_contents():
    plain, growing = layers()
    for layer in (plain, growing):
        layer.update(*kv(rows=4, length=6))
        layer.update(*kv(rows=4, seed=1))
        layer.batch_select_indices(torch.tensor([3, 0]))          # a finished row leaves, rows reorder
        layer.keys, layer.values = layer.keys[:, :, 2:], layer.values[:, :, 2:]   # padding columns trimmed
        layer.update(*kv(rows=2, seed=2))
        extra_k, extra_v = kv(rows=1, length=layer.get_seq_length(), seed=3)   # a newcomer merged in
        layer.keys, layer.values = torch.cat([layer.keys, extra_k]), torch.cat([layer.values, extra_v])
        layer.update(*kv(rows=3, seed=4))
    assert torch.equal(growing.keys, plain.keys) and torch.equal(growing.values, plain.values)
    assert growing.keys.shape == (3, 2, 7, 4)


def test_reset_and_an_empty_layer_start_over():
    _, growing = layers()
    growing.update(*kv(length=4))
    growing.reset()
    assert growing.get_seq_length() == 0
    k, v = kv(length=2, seed=5)
    keys, values = growing.update(k, v)
    assert torch.equal(keys, k) and torch.equal(values, v)


def test_a_model_decodes_the_same_logits_through_the_growing_cache():
    model = AutoModelForCausalLM.from_pretrained(resolve("tiny-random"), dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    outs = []
    with torch.no_grad():
        for grow in (False, True):
            cache = DynamicCache(config=model.config)
            if grow:
                assert grow_in_place(cache) is cache and all(type(l) is GrowingLayer for l in cache.layers)
            logits = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]]
            token = logits[-1].argmax(-1, keepdim=True)
            for _ in range(MIN_ROOM + 5):   # past the first buffer's room
                logits.append(model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1])
                token = logits[-1].argmax(-1, keepdim=True)
            outs.append(torch.stack(logits))
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_the_engine_s_row_operations_keep_the_buffers_and_match_plain_tensors():
    plain, growing = layers()
    for layer in (plain, growing):
        layer.update(*kv(rows=4, length=6))
        layer.update(*kv(rows=4, seed=1))
    index = torch.tensor([3, 0])
    plain.batch_select_indices(index)
    growing.batch_select_indices(index)
    plain.keys, plain.values = plain.keys[:, :, 2:], plain.values[:, :, 2:]
    growing.drop_front(2)
    newcomer = kv(rows=1, length=3, seed=3)
    width = 5
    padded = [torch.cat([torch.zeros(1, 2, width - 3, 4), t], 2) for t in newcomer]
    plain.keys, plain.values = torch.cat([plain.keys, padded[0]]), torch.cat([plain.values, padded[1]])
    growing.set_rows([(growing.keys, growing.values), newcomer], width)
    assert torch.equal(growing.keys, plain.keys) and torch.equal(growing.values, plain.values)
    buffer = growing.keys.data_ptr()
    step = kv(rows=3, seed=4)
    plain.update(*step), growing.update(*step)
    assert growing.keys.data_ptr() == buffer   # owned: the step wrote in place, nothing was adopted
    assert torch.equal(growing.keys, plain.keys) and torch.equal(growing.values, plain.values)
