"""The prefix KV cache's bookkeeping: longest shared prefix, exact hits only with logits, budget, eviction."""

import numpy as np
import pytest
import torch

from turnrl.engines.prefix_cache import Entry, PrefixCache, common_prefix


def entry(tokens, logits=False):
    n = len(tokens)
    kv = [torch.arange(n, dtype=torch.float32).view(1, n, 1)]  # one layer, one head, dim 1: position ids
    return Entry(np.asarray(tokens, dtype=np.int64), kv, [t.clone() for t in kv],
                 torch.zeros(4) if logits else None)


def test_common_prefix():
    a = np.array([1, 2, 3, 4])
    assert common_prefix(a, np.array([1, 2, 3, 4])) == 4
    assert common_prefix(a, np.array([1, 2, 9, 4])) == 2
    assert common_prefix(a, np.array([1, 2])) == 2
    assert common_prefix(a, np.array([7])) == 0
    assert common_prefix(a, np.array([], dtype=np.int64)) == 0


def test_lookup_picks_the_longest_shared_prefix_and_keeps_one_token_to_feed():
    cache = PrefixCache(1000, min_match=2)
    cache.store(entry(range(10)))
    cache.store(entry([0, 1, 2, 3, 4, 5, 99, 98]))
    hit, reuse = cache.lookup(list(range(20)))
    assert list(hit.tokens) == list(range(10)) and reuse == 10
    hit, reuse = cache.lookup([0, 1, 2, 3, 4, 5, 99, 98, 97])
    assert list(hit.tokens[:7]) == [0, 1, 2, 3, 4, 5, 99] and reuse == 8
    # the whole prompt is cached but without logits: reuse all but the last token, which must be fed
    hit, reuse = cache.lookup(list(range(10)))
    assert reuse == 9
    # a prompt shorter than the entry reuses its own prefix of it
    assert cache.lookup(list(range(6)))[1] == 5
    assert cache.stats["hits"] == 4 and cache.stats["exact_hits"] == 0


def test_exact_hit_needs_the_next_token_logits():
    cache = PrefixCache(1000, min_match=2)
    cache.store(entry([5, 6, 7], logits=True))
    hit, reuse = cache.lookup([5, 6, 7])
    assert reuse == 3 and hit.logits is not None and cache.stats["exact_hits"] == 1


def test_short_matches_are_not_hits():
    cache = PrefixCache(1000, min_match=4)
    cache.store(entry([1, 2, 3, 4, 5]))
    assert cache.lookup([1, 2, 3, 9, 9]) == (None, 0)
    assert cache.lookup([1, 2, 3, 4, 9])[1] == 4


def test_an_entry_replaces_the_entries_it_extends_and_keeps_their_logits():
    cache = PrefixCache(1000, min_match=2)
    cache.store(entry([1, 2, 3], logits=True))
    cache.store(entry([1, 2, 3, 4, 5]))
    cache.store(entry([1, 2, 8]))
    assert len(cache) == 2 and cache.cached_tokens == 8
    cache.store(entry([1, 2, 8]))  # the same tokens again: replaced, not duplicated
    assert len(cache) == 2 and cache.cached_tokens == 8


def test_least_recently_used_entries_leave_first_under_the_token_budget():
    cache = PrefixCache(10, min_match=2)
    cache.store(entry([1, 1, 1, 1]))
    cache.store(entry([2, 2, 2, 2]))
    cache.lookup([1, 1, 1, 1, 5])               # touches the first entry
    cache.store(entry([3, 3, 3, 3]))            # 12 tokens > 10: the least recently used one goes
    assert cache.lookup([2, 2, 2, 2, 5]) == (None, 0)
    assert cache.lookup([1, 1, 1, 1, 5])[1] == 4 and cache.cached_tokens == 8 and cache.stats["evicted"] == 1
    cache.store(entry(list(range(11))))         # bigger than the whole budget: not kept
    assert cache.cached_tokens == 8
    cache.clear()
    assert len(cache) == 0 and cache.cached_tokens == 0 and cache.lookup([1, 1, 1, 1, 5]) == (None, 0)


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError, match="must be positive"):
        PrefixCache(0)
