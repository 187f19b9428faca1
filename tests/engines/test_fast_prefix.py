"""The fast engine's prefix cache (turnrl/engines/fast/slots.py) on the CPU, tiny-random in float32: a later turn
prefills only its new tokens, a group's samples share their prompt's prefill, parked slots are evicted least
recently used first, new weights drop what is cached, and every answer equals the same engine's without the cache
(tokens identical, logprobs to float noise)."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from turnrl.engines.base import Sampling
from turnrl.engines.fast import FastEngine
from turnrl.models import prepare

PROMPT = list(range(200, 240))            # 40 tokens: past the 16-token minimum match
DELTA = [7, 8, 9, 10, 11]                 # a tool result's tokens, say


def build(cache: bool, slots: int = 8, model=None):
    model = model or AutoModelForCausalLM.from_pretrained(prepare("tiny-random"), dtype=torch.float32)
    engine = FastEngine("", device="cpu", dtype="float32", max_batch_size=slots, max_len=256, gather_ms=20,
                        model=model, prefix_cache=cache)
    asyncio.run(engine.generate([1, 2, 3], Sampling(max_tokens=2)))   # pins the worker's thread count (conftest)
    return engine


@pytest.fixture()
def engines(torch_threads):
    with torch_threads(1):
        pair = build(True), build(False)
        yield pair
    for engine in pair:
        asyncio.run(engine.close())


def gen(engine, *requests):
    async def all_of_them():
        return await asyncio.gather(*(engine.generate(p, s) for p, s in requests))
    return asyncio.run(all_of_them())


def same(a, b):
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-4


def prefilled(engine, *requests):
    before = engine.stats["prefill_tokens"]
    outs = gen(engine, *requests)
    return outs, engine.stats["prefill_tokens"] - before


def test_a_later_turn_prefills_only_its_new_tokens(engines):
    cached, plain = engines
    first = Sampling(max_tokens=12, temperature=1.0, seed=5)
    (a,), n1 = prefilled(cached, (PROMPT, first))
    (b,), _ = prefilled(plain, (PROMPT, first))
    same(a, b)
    assert n1 == len(PROMPT) and len(a.token_ids) == 12
    turn2 = PROMPT + a.token_ids + DELTA
    (c,), n2 = prefilled(cached, (turn2, Sampling(max_tokens=10, temperature=1.0, seed=6)))
    (d,), m2 = prefilled(plain, (turn2, Sampling(max_tokens=10, temperature=1.0, seed=6)))
    same(c, d)
    # the parked slot holds all but the last two sampled tokens (see engine._deliver): 2 + the delta are new
    assert n2 == 2 + len(DELTA) and m2 == len(turn2)
    assert cached.stats["parked_reuses"] == 1 and cached.stats["prefix_hit_tokens"] == len(turn2) - n2


def test_a_group_prefills_its_shared_prompt_once_and_samples_as_without_the_cache(engines):
    cached, plain = engines
    group = [(PROMPT, Sampling(max_tokens=8, temperature=1.0, seed=s)) for s in range(6)]
    outs, n = prefilled(cached, *group)
    theirs, m = prefilled(plain, *group)
    for a, b in zip(outs, theirs):
        same(a, b)
    assert len({tuple(o.token_ids) for o in outs}) > 1                  # seeds differ: samples differ
    # one prefill of the prompt, then 5 copies of its first 39 tokens, each prefilling only the last token
    assert n == len(PROMPT) + 5 and m == 6 * len(PROMPT)
    assert cached.stats["prefix_copies"] == 5 and cached.stats["deferred"] == 5


def test_prompts_sharing_a_prefix_share_its_kv_and_short_prompts_are_untouched(engines):
    cached, plain = engines
    system = list(range(300, 330))
    requests = [(system + [40 + i] * (3 + i), Sampling(max_tokens=6, temperature=0.0)) for i in range(3)]
    requests.append(([1, 8, 9], Sampling(max_tokens=6, temperature=0.0)))   # under the minimum: never shared
    outs, n = prefilled(cached, *requests)
    theirs, _ = prefilled(plain, *requests)
    for a, b in zip(outs, theirs):
        same(a, b)
    assert n == len(requests[0][0]) + (3 + 1) + (3 + 2) + 3


def test_parked_slots_are_evicted_least_recently_used_first(torch_threads):
    with torch_threads(1):
        cached, plain = build(True, slots=2), build(False, slots=2)
    try:
        sessions = {name: [base + i for i in range(30)] for name, base in (("a", 400), ("b", 500), ("c", 600))}
        outs = {}
        for name in "abc":                         # c's turn takes the slot a parked in (least recently used)
            (outs[name],), _ = prefilled(cached, (sessions[name], Sampling(max_tokens=6, temperature=0.0)))
        assert cached.stats["evicted"] == 1 and sorted(cached.slots.parked) == [0, 1]
        for name, hit in (("a", False), ("c", True)):
            turn2 = sessions[name] + outs[name].token_ids + DELTA
            (x,), n = prefilled(cached, (turn2, Sampling(max_tokens=6, temperature=0.0)))
            (y,), _ = prefilled(plain, (turn2, Sampling(max_tokens=6, temperature=0.0)))
            same(x, y)
            assert n == (2 + len(DELTA) if hit else len(turn2))
    finally:
        for engine in (cached, plain):
            asyncio.run(engine.close())


def test_new_weights_drop_the_cache(torch_threads):
    with torch_threads(1):
        cached, plain = build(True), build(False)
    try:
        (a,), _ = prefilled(cached, (PROMPT, Sampling(max_tokens=8, temperature=0.0)))
        new = {name: p + 0.05 * torch.randn_like(p) for name, p in cached.model.state_dict().items()}
        for engine in (cached, plain):
            asyncio.run(engine.update_weights(new.items(), 1))
        turn2 = PROMPT + a.token_ids + DELTA
        (x,), n = prefilled(cached, (turn2, Sampling(max_tokens=8, temperature=0.0)))
        (y,), _ = prefilled(plain, (turn2, Sampling(max_tokens=8, temperature=0.0)))
        same(x, y)
        assert n == len(turn2)                     # planned on the parked slot, prefilled in full
        (z,), n3 = prefilled(cached, (turn2 + x.token_ids + DELTA, Sampling(max_tokens=4, temperature=0.0)))
        assert n3 == 2 + len(DELTA)                # what was computed under the new weights is reused again
    finally:
        for engine in (cached, plain):
            asyncio.run(engine.close())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_groups_and_later_turns_with_graphs_equal_the_engine_without_the_cache():
    from tests.engines.test_fast import shape_model
    model = shape_model(torch.float32)
    cached, plain = (FastEngine("", device="cuda", dtype="float32", model=model, max_batch_size=32, max_len=512,
                                prefix_cache=cache) for cache in (True, False))
    try:
        prompts = [list(range(100 + 50 * g, 140 + 50 * g)) for g in range(4)]   # the shape model has 1024 tokens
        group = [(p, Sampling(max_tokens=24, temperature=1.0, seed=7 * g + s)) for g, p in enumerate(prompts)
                 for s in range(4)]
        outs, n = prefilled(cached, *group)
        theirs, _ = prefilled(plain, *group)
        for a, b in zip(outs, theirs):
            same(a, b)
        assert n == 4 * 40 + 12                       # each prompt once, its 3 siblings one token each
        later = [(p + o.token_ids + DELTA, Sampling(max_tokens=16, temperature=0.0)) for (p, _), o in zip(group, outs)]
        outs2, n2 = prefilled(cached, *later)
        theirs2, _ = prefilled(plain, *later)
        for a, b in zip(outs2, theirs2):
            same(a, b)
        assert n2 == 16 * (2 + len(DELTA))
    finally:
        for engine in (cached, plain):
            asyncio.run(engine.close())


def test_the_config_switch_reaches_the_fast_engine(torch_threads):
    from turnrl.config.schema import EngineConfig
    from turnrl.engines.factory import build_engine
    for on in (True, False):
        cfg = EngineConfig(kind="hf", fast="on", device="cpu", dtype="float32", max_batch_size=2,
                           max_model_len=128, fast_prefix_cache=on)
        with torch_threads(1):
            engine = build_engine(cfg, prepare("tiny-random"))
        try:
            assert engine.slots.enabled is on
        finally:
            asyncio.run(engine.close())



def test_later_turns_are_budgeted_by_their_new_tokens_not_their_whole_prompts(torch_threads):
    # a budget of 3 first prompts a prefill: the 6 first turns take 2 admissions; their 6 later turns hold
    # 6 x (2 + 5) new tokens (the delta and the two sampled tokens the slot lacks), so one admission takes all
    with torch_threads(1):
        model = AutoModelForCausalLM.from_pretrained(prepare("tiny-random"), dtype=torch.float32)
        engine = FastEngine("", device="cpu", dtype="float32", max_batch_size=8, max_len=256, gather_ms=50,
                            model=model, prefix_cache=True, prefill_tokens=3 * len(PROMPT))
        try:
            prompts = [[300 + i] + PROMPT[1:] for i in range(6)]   # distinct from the first token: no sharing
            first = [(p, Sampling(max_tokens=12, temperature=1.0, seed=i)) for i, p in enumerate(prompts)]
            before = engine.stats["admissions"]
            outs = gen(engine, *first)
            assert engine.stats["admissions"] - before == 2
            later = [(p + o.token_ids + DELTA, Sampling(max_tokens=4, temperature=1.0, seed=10 + i))
                     for i, (p, o) in enumerate(zip(prompts, outs))]
            before, filled = engine.stats["admissions"], engine.stats["prefill_tokens"]
            gen(engine, *later)
            assert engine.stats["admissions"] - before == 1
            assert engine.stats["prefill_tokens"] - filled == 6 * (2 + len(DELTA))
        finally:
            asyncio.run(engine.close())
