"""Packed admissions (turnrl/engines/fast/admit.py): rows padded to buckets, staged in two copies, run as one
function (captured as CUDA graphs on the GPU) answer exactly as the plain admission does, with and without the
prefix cache, for every sampling variant; padded rows only touch the spare slot."""

import asyncio
import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from turnrl.engines.base import Sampling
from turnrl.engines.fast import FastEngine
from turnrl.engines.fast.admit import bucket
from turnrl.models import prepare
from tests.engines.test_fast_prefix import DELTA, PROMPT, same
from tests.engines.test_fast_prefix import gen as gen_each


def gen(engine, requests):
    return gen_each(engine, *requests)


@contextlib.contextmanager
def packed_and_plain(**kwargs):
    """Two CPU engines on one tiny-random model, float32: admissions packed (eager) and plain."""
    model = AutoModelForCausalLM.from_pretrained(prepare("tiny-random"), dtype=torch.float32)
    pair = [FastEngine("", device="cpu", dtype="float32", model=model, packed_admissions=on, **kwargs)
            for on in (True, False)]
    try:
        yield pair
    finally:
        for engine in pair:
            asyncio.run(engine.close())


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 17, 32, 33, 81, 256)] == [1, 2, 4, 8, 32, 32, 64, 128, 256]
    assert [bucket(n, 16) for n in (1, 16, 17, 44, 129, 1100)] == [16, 16, 32, 64, 256, 2048]


def requests(first_outs=None):
    """Three groups of 3 (odd counts: padded rows), mixed sampling; later turns continue the first turns."""
    if first_outs is None:
        kinds = [dict(temperature=1.0), dict(temperature=0.0), dict(temperature=0.8, top_k=5, top_p=0.9)]
        return [([300 + g] + PROMPT[1:], Sampling(max_tokens=10, seed=3 * g + s, **kinds[g]))
                for g in range(3) for s in range(3)]
    firsts = requests()
    later = [(p + o.token_ids + DELTA, Sampling(max_tokens=6, temperature=1.0, seed=50 + i))
             for i, ((p, _), o) in enumerate(zip(firsts, first_outs))]
    # the first request again (same seed, so the same tokens), stopped at its first token and at a later one
    (prompt, again), answer = firsts[0], first_outs[0].token_ids
    later_stop = next(t for k, t in enumerate(answer) if k and t not in answer[:k])
    return later + [(prompt, again.with_(stop_token_ids=(answer[0],))),
                    (prompt, again.with_(stop_token_ids=(later_stop,))),
                    ([5, 6, 7], Sampling(max_tokens=1, temperature=1.0, seed=99))]   # done at its first token


@pytest.mark.parametrize("cache", [True, False])
def test_packed_admissions_answer_as_plain_ones(torch_threads, cache):
    with torch_threads(1), packed_and_plain(max_batch_size=16, max_len=256, gather_ms=30,
                                            prefix_cache=cache) as (packed, plain):
        assert packed.admit.packed and not plain.admit.packed
        spare = packed.admit.spare
        assert spare == 16 and packed.state.count[spare] == 0
        outs = gen(packed, requests())
        for a, b in zip(outs, gen(plain, requests())):
            same(a, b)
        assert packed.state.count[spare] == 1          # padded rows wrote the spare slot, only it
        assert len({len(o.token_ids) for o in outs}) == 1 and len(outs[0].token_ids) == 10
        later = requests(outs)
        outs2 = gen(packed, later)
        for a, b in zip(outs2, gen(plain, later)):
            same(a, b)
        assert len(outs2[-1].token_ids) == 1 and outs2[-1].finish_reason == "length"
        answer = outs[0].token_ids
        assert (outs2[-3].token_ids, outs2[-3].finish_reason) == (answer[:1], "stop")
        assert outs2[-2].finish_reason == "stop" and outs2[-2].token_ids == answer[:len(outs2[-2].token_ids)]
        assert len(outs2[-2].token_ids) > 1
        assert packed.stats["admit_packed"] > 0 and packed.stats["admit_plain"] == 0
        assert plain.stats["admit_plain"] > 0 and plain.stats["admit_packed"] == 0
        if cache:
            assert packed.stats["prefill_tokens"] == plain.stats["prefill_tokens"]
            assert packed.stats["prefix_hit_tokens"] > 0


def test_a_bucket_over_the_budget_is_admitted_at_its_exact_size(torch_threads):
    # prefill_tokens 8: packed buckets hold 32 tokens at most, so a 40-token prompt (a 64-wide bucket) goes plain
    with torch_threads(1), packed_and_plain(max_batch_size=4, max_len=128, prefill_tokens=8) as (packed, plain):
        asks = [(PROMPT, Sampling(max_tokens=5, temperature=1.0, seed=1))]
        for a, b in zip(gen(packed, asks), gen(plain, asks)):
            same(a, b)
        assert (packed.stats["admit_plain"], packed.stats["admit_packed"]) == (1, 0)
        asks = [([5, 6, 7], Sampling(max_tokens=5, temperature=1.0, seed=2))]
        for a, b in zip(gen(packed, asks), gen(plain, asks)):
            same(a, b)
        assert (packed.stats["admit_plain"], packed.stats["admit_packed"]) == (1, 1)


def test_packed_admissions_refuse_the_exact_engine(torch_threads):
    with torch_threads(1):
        model = AutoModelForCausalLM.from_pretrained(prepare("tiny-random"), dtype=torch.float32)
        with pytest.raises(ValueError, match="engine.exact off"):
            FastEngine("", device="cpu", dtype="float32", model=model, max_batch_size=2, max_len=64, exact=True,
                       packed_admissions=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache", [False, True])
def test_gpu_admission_graphs_answer_as_plain_admissions(cache):
    from tests.engines.test_fast import shape_model
    model = shape_model(torch.float32)
    graphs, plain = (FastEngine("", device="cuda", dtype="float32", model=model, max_batch_size=32, max_len=512,
                                gather_ms=30, prefix_cache=cache, packed_admissions=on) for on in (None, False))
    try:
        assert graphs.admit.use_graphs and not plain.admit.packed
        outs = gen(graphs, requests())
        for a, b in zip(outs, gen(plain, requests())):
            same(a, b)
        later = requests(outs)
        for a, b in zip(gen(graphs, later), gen(plain, later)):
            same(a, b)
        assert graphs.stats["admit_captured"] >= 2
        if not cache:           # the same buckets again: replayed
            for a, b in zip(gen(graphs, requests()), outs):
                same(a, b)
            assert graphs.stats["admit_replayed"] >= 1
        assert not [note for note in graphs.notes if "admission" in note], graphs.notes
    finally:
        for engine in (graphs, plain):
            asyncio.run(engine.close())


def test_the_config_switch_reaches_the_engine(torch_threads, monkeypatch):
    import turnrl.engines.fast as fast
    from turnrl.config.schema import EngineConfig
    from turnrl.engines.factory import build_engine
    seen = {}

    class Recording(fast.FastEngine):
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)
            super().__init__(*args, **kwargs)
    monkeypatch.setattr(fast, "FastEngine", Recording)
    assert EngineConfig().fast_admission_graphs is False     # off by default: README "Admissions as CUDA graphs"
    for on, passed in ((True, None), (False, False)):
        cfg = EngineConfig(kind="hf", fast="on", device="cpu", dtype="float32", max_batch_size=2, max_model_len=128,
                           fast_admission_graphs=on)
        with torch_threads(1):
            engine = build_engine(cfg, prepare("tiny-random"))
        try:
            assert seen["packed_admissions"] is passed and not engine.admit.packed   # the CPU has no graphs
        finally:
            asyncio.run(engine.close())
