"""The embedded HF engine: continuous batching, per-request seeds, exact greedy decoding and logprobs, stops,
cancellation and weight updates. Tiny random model where only mechanics matter, SmolLM2 (float32) where the
numbers must match transformers itself."""

import asyncio

import pytest
import torch

from turnrl.engines.base import EngineError, Sampling
from turnrl.engines.hf import HFEngine, _Request, sample_rows
from turnrl.models import prepare

IM_END = 2


def make_engine(path, **kwargs):
    engine = HFEngine(str(path), device="cpu", dtype="float32", **kwargs)
    asyncio.run(engine.generate([1, 2, 3], Sampling(max_tokens=1)))  # pins the worker's thread count (conftest)
    return engine


@pytest.fixture(scope="module")
def tiny(torch_threads):
    with torch_threads(1):
        engine = make_engine(prepare("tiny-random"), gather_ms=20)
        yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def smol(smollm2_dir, torch_threads):
    with torch_threads(1):
        engine = make_engine(smollm2_dir)
        yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def chat_prompt(smol_tokenizer):
    def prompt(question):
        return smol_tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    return prompt


def generate(engine, *requests):
    """Run (prompt, sampling) requests concurrently on one event loop."""
    async def all_of_them():
        return await asyncio.gather(*(engine.generate(p, s) for p, s in requests))
    return asyncio.run(all_of_them())


PROMPTS = [[1, 450, 2301, 1123, 47, 330], [1, 8, 9], list(range(100, 140)), [5, 6, 7, 8, 9, 10, 11]]


# -- batching ---------------------------------------------------------------------------------------------
def test_concurrent_requests_decode_together(tiny):
    before = dict(tiny.stats)
    outs = generate(tiny, *[(p, Sampling(max_tokens=12, temperature=1.0, seed=i)) for i, p in enumerate(PROMPTS)])
    assert [len(o.token_ids) for o in outs] == [12] * 4 and all(o.finish_reason == "length" for o in outs)
    steps = tiny.stats["decode_steps"] - before["decode_steps"]
    generated = tiny.stats["generated_tokens"] - before["generated_tokens"]
    assert generated == 48 and steps < 48 // 2       # one step serves several requests
    assert tiny.stats["prefill_tokens"] - before["prefill_tokens"] == sum(len(p) for p in PROMPTS)


def test_a_request_joining_a_running_batch_gets_the_same_tokens_as_alone(tiny):
    long = (PROMPTS[2], Sampling(max_tokens=40, temperature=1.0, seed=11, stop_token_ids=()))
    late = (PROMPTS[0], Sampling(max_tokens=8, temperature=1.0, seed=12, stop_token_ids=()))
    alone_long, = generate(tiny, long)
    alone_late, = generate(tiny, late)

    async def staggered():
        first = asyncio.create_task(tiny.generate(*long))
        start = tiny.stats["decode_steps"]
        while tiny.stats["decode_steps"] < start + 1:   # the long request is decoding, 39 steps to go (not
            await asyncio.sleep(0.001)                   # longer: batch float noise flips samples more often)
        second = await tiny.generate(*late)
        assert not first.done()                      # admitted while the other one was running
        return await first, second
    together_long, together_late = asyncio.run(staggered())
    assert together_long.token_ids == alone_long.token_ids and together_late.token_ids == alone_late.token_ids
    assert together_long.logprobs == pytest.approx(alone_long.logprobs, abs=1e-4)


@pytest.mark.parametrize("engine_name", ["tiny", "smol"])
def test_per_request_seed_gives_the_same_tokens_whatever_else_is_in_the_batch(request, engine_name, chat_prompt):
    engine = request.getfixturevalue(engine_name)
    target = chat_prompt("Tell me a fact about cats.")
    sampling = Sampling(max_tokens=16, temperature=1.0, seed=1234, stop_token_ids=())
    alone, = generate(engine, (target, sampling))
    others = [(p, Sampling(max_tokens=n, temperature=1.0, seed=n)) for p, n in zip(PROMPTS, (5, 20, 9, 3))]
    batched = generate(engine, others[0], others[1], (target, sampling), others[2], others[3])[2]
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == pytest.approx(alone.logprobs, abs=1e-3)
    other_seed, = generate(engine, (target, sampling.with_(seed=4321)))
    assert other_seed.token_ids != alone.token_ids


# -- exactness against transformers -------------------------------------------------------------------------
def test_greedy_equals_transformers_generate(smol, chat_prompt):
    prompt = chat_prompt("What is the capital of France?")
    out, = generate(smol, (prompt, Sampling(max_tokens=12, temperature=0.0, stop_token_ids=(IM_END,))))
    with torch.no_grad():
        reference = smol.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                        do_sample=False, max_new_tokens=12, eos_token_id=IM_END,
                                        pad_token_id=IM_END)[0, len(prompt):].tolist()
    assert out.token_ids == reference


def test_top_k_one_equals_greedy(smol, chat_prompt):
    prompt = chat_prompt("Name three fruits.")
    greedy, top1 = generate(smol, (prompt, Sampling(max_tokens=10, temperature=0.0, seed=1)),
                            (prompt, Sampling(max_tokens=10, temperature=1.0, top_k=1, seed=2)))
    assert top1.token_ids == greedy.token_ids
    assert top1.logprobs == pytest.approx(greedy.logprobs, abs=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_the_log_softmax_of_a_full_forward_pass(smol, chat_prompt, temperature):
    prompt = chat_prompt("Write one sentence about rain.")
    out, = generate(smol, (prompt, Sampling(max_tokens=12, temperature=temperature, seed=5, stop_token_ids=())))
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = smol.model(ids).logits[0, len(prompt) - 1:-1].float()
    expected = torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert (torch.tensor(out.logprobs) - expected).abs().max().item() < 1e-3
    assert all(lp <= 0 for lp in out.logprobs)


def test_stop_token_ends_with_stop_and_is_included_length_otherwise(smol, chat_prompt):
    prompt = chat_prompt("Say hello.")
    stopped, cut = generate(smol, (prompt, Sampling(max_tokens=40, temperature=0.0, stop_token_ids=(IM_END,))),
                            (prompt, Sampling(max_tokens=3, temperature=0.0, stop_token_ids=(IM_END,))))
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == IM_END
    assert IM_END not in stopped.token_ids[:-1] and len(stopped.logprobs) == len(stopped.token_ids)
    assert cut.finish_reason == "length" and cut.token_ids == stopped.token_ids[:3]


# -- prefix cache -------------------------------------------------------------------------------------------
def test_a_later_turn_reuses_the_earlier_turns_kv_and_decodes_as_a_full_forward(smol, chat_prompt, smol_tokenizer):
    first = chat_prompt("Give me a short tip for studying.")
    turn1, = generate(smol, (first, Sampling(max_tokens=24, temperature=1.0, seed=8, stop_token_ids=(IM_END,))))
    delta = smol_tokenizer.encode("\n<|im_start|>user\nWhy does that help?<|im_end|>\n<|im_start|>assistant\n")
    second = first + turn1.token_ids + delta
    before = dict(smol.stats)
    turn2, = generate(smol, (second, Sampling(max_tokens=12, temperature=0.0, stop_token_ids=())))
    cached = len(first) + len(turn1.token_ids) - 1   # every token turn 1 fed through the model
    assert smol.stats["prefix_hit_tokens"] - before["prefix_hit_tokens"] == cached
    assert smol.stats["prefill_tokens"] - before["prefill_tokens"] == len(second) - cached
    ids = torch.tensor([second + turn2.token_ids])
    with torch.no_grad():
        logits = smol.model(ids).logits[0, len(second) - 1:-1].float()
    assert turn2.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(turn2.token_ids)[:, None])[:, 0]
    assert (torch.tensor(turn2.logprobs) - expected).abs().max().item() < 1e-3


def test_identical_prompts_are_prefilled_once_and_sample_as_if_alone(tiny, torch_threads):
    prompt = list(range(300, 340))
    requests = [(prompt, Sampling(max_tokens=6, temperature=1.0, seed=40 + i, stop_token_ids=())) for i in range(4)]
    before = dict(tiny.stats)
    together = generate(tiny, *requests)
    assert tiny.stats["requests"] - before["requests"] == 4
    assert tiny.stats["prefill_tokens"] - before["prefill_tokens"] == len(prompt)
    with torch_threads(1):
        plain = make_engine(prepare("tiny-random"), gather_ms=0, prefix_cache_tokens=0)
    try:
        alone = [generate(plain, r)[0] for r in requests]
    finally:
        asyncio.run(plain.close())
    assert plain.prefix is None
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in together}) > 1   # one prefill, still independent samples
    for mine, theirs in zip(together, alone):
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)
    again, = generate(tiny, requests[0])                     # an exact hit: the stored logits, no forward
    assert again.token_ids == together[0].token_ids


def test_a_weight_update_empties_the_prefix_cache(torch_threads):
    with torch_threads(1):
        engine = make_engine(prepare("tiny-random"), gather_ms=0)
    try:
        prompt = list(range(500, 530))
        generate(engine, (prompt, Sampling(max_tokens=3, seed=1)))
        assert len(engine.prefix) > 0
        asyncio.run(engine.update_weights(list(engine.model.state_dict().items())[:1], version=1))
        assert len(engine.prefix) == 0
        before = engine.stats["prefill_tokens"]
        generate(engine, (prompt, Sampling(max_tokens=3, seed=1)))
        assert engine.stats["prefill_tokens"] - before == len(prompt)
    finally:
        asyncio.run(engine.close())


# -- control ------------------------------------------------------------------------------------------------
def test_cancelling_a_request_aborts_it(tiny):
    async def scenario():
        task = asyncio.create_task(tiny.generate(PROMPTS[0], Sampling(max_tokens=5000, stop_token_ids=())))
        start = tiny.stats["generated_tokens"]
        while tiny.stats["generated_tokens"] < start + 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after = await tiny.generate(PROMPTS[1], Sampling(max_tokens=4, seed=3))
        return start, after
    start, after = asyncio.run(scenario())
    assert len(after.token_ids) == 4
    settled = tiny.stats["generated_tokens"]
    assert settled - start < 500                     # the cancelled request stopped decoding
    asyncio.run(asyncio.sleep(0.05))
    assert tiny.stats["generated_tokens"] == settled


def test_update_weights_changes_outputs_and_accepts_tied_names(tiny):
    sampling = Sampling(max_tokens=8, temperature=0.0, stop_token_ids=())
    before, = generate(tiny, (PROMPTS[3], sampling))
    original = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    assert "lm_head.weight" in original                       # tied to the embeddings
    changed = {k: v + 0.5 * torch.randn_like(v) if v.is_floating_point() else v for k, v in original.items()}
    asyncio.run(tiny.update_weights(changed.items(), version=3))
    after, = generate(tiny, (PROMPTS[3], sampling))
    assert tiny.version == 3 and after.token_ids != before.token_ids
    asyncio.run(tiny.update_weights(original.items(), version=4))
    restored, = generate(tiny, (PROMPTS[3], sampling))
    assert restored.token_ids == before.token_ids
    with pytest.raises(EngineError, match="no parameter 'nope.weight'"):
        asyncio.run(tiny.update_weights([("nope.weight", torch.zeros(1))], version=5))


def test_bad_requests_and_close(torch_threads):
    with torch_threads(1):
        engine = make_engine(prepare("tiny-random"), gather_ms=0)
    with pytest.raises(EngineError, match="empty prompt"):
        asyncio.run(engine.generate([], Sampling(max_tokens=2)))
    with pytest.raises(EngineError, match="max_tokens must be at least 1, got 0"):
        asyncio.run(engine.generate([1, 2], Sampling(max_tokens=0)))

    async def close_while_busy():
        task = asyncio.create_task(engine.generate(PROMPTS[0], Sampling(max_tokens=10_000, stop_token_ids=())))
        await asyncio.sleep(0.2)
        await engine.close()
        with pytest.raises(EngineError, match="engine closed"):
            await task
        with pytest.raises(EngineError, match="engine is closed"):
            await engine.generate([1, 2], Sampling(max_tokens=2))
    asyncio.run(close_while_busy())


# -- sampling rows ------------------------------------------------------------------------------------------
def fake_request(**sampling):
    return _Request([1], Sampling(max_tokens=1, **sampling), None, None, torch.Generator().manual_seed(0))


def test_sampling_never_picks_a_token_outside_top_k_even_at_u_zero(monkeypatch):
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(1))
    tokens, logps = sample_rows(logits, [fake_request(top_k=2)])
    assert tokens.tolist() == [1]
    assert logps.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    picked = set()
    for seed in range(200):
        req = fake_request(top_p=0.6)
        req.generator.manual_seed(seed)
        picked.add(sample_rows(logits, [req])[0].item())
    assert picked == {0, 1}
