"""The fast engine (turnrl/engines/fast): on the CPU it runs the same code eagerly, so exactness against
transformers, per-request seeds, stops, slots, cancellation and weight updates are checked here; the GPU-only
paths (CUDA graphs, torch.compile) are checked by the `gpu`-marked tests at the end against the eager path."""

import asyncio

import pytest
import torch

from turnrl.engines.base import EngineError, Sampling
from turnrl.engines.fast import FastEngine, build_hf_engine, unsupported_reason
from turnrl.engines.fast.sampling import sample, seed_key, uniform
from turnrl.engines.hf import HFEngine
from turnrl.models import prepare

IM_END = 2
PROMPTS = [[1, 450, 2301, 1123, 47, 330], [1, 8, 9], list(range(100, 140)), [5, 6, 7, 8, 9, 10, 11]]


def make_engine(path, **kwargs):
    kwargs = {"device": "cpu", "dtype": "float32", "max_batch_size": 8, "max_len": 256, **kwargs}
    engine = FastEngine(str(path), **kwargs)
    asyncio.run(engine.generate([1, 2, 3], Sampling(max_tokens=2)))  # pins the worker's thread count (conftest)
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
        engine = make_engine(smollm2_dir, max_len=512)
        yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def chat_prompt(smol_tokenizer):
    def prompt(question):
        return smol_tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    return prompt


def generate(engine, *requests):
    async def all_of_them():
        return await asyncio.gather(*(engine.generate(p, s) for p, s in requests))
    return asyncio.run(all_of_them())


def reference_greedy(model, prompt, n, stop=None):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, eos_token_id=stop, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# -- exactness against transformers -------------------------------------------------------------------------
def test_greedy_equals_transformers_generate_on_smollm2(smol, chat_prompt):
    prompts = [chat_prompt(q) for q in ("What is the capital of France?", "Name three fruits.", "Say hello.")]
    outs = generate(smol, *[(p, Sampling(max_tokens=16, temperature=0.0, stop_token_ids=(IM_END,))) for p in prompts])
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(smol.model, prompt, 16, IM_END)


def test_greedy_equals_transformers_generate_and_the_hf_engine_on_the_tiny_model(tiny, torch_threads):
    sampling = Sampling(max_tokens=12, temperature=0.0, stop_token_ids=())
    outs = generate(tiny, *[(p, sampling) for p in PROMPTS])
    with torch_threads(1):
        plain = HFEngine("", device="cpu", dtype="float32", model=tiny.model, gather_ms=0)
    try:
        theirs = generate(plain, *[(p, sampling) for p in PROMPTS])
    finally:
        asyncio.run(plain.close())
    for prompt, out, other in zip(PROMPTS, outs, theirs):
        assert out.token_ids == reference_greedy(tiny.model, prompt, 12) == other.token_ids
        assert out.logprobs == pytest.approx(other.logprobs, abs=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_the_log_softmax_of_a_full_forward_pass(smol, chat_prompt, temperature):
    prompt = chat_prompt("Write one sentence about rain.")
    out, = generate(smol, (prompt, Sampling(max_tokens=12, temperature=temperature, seed=5, stop_token_ids=())))
    with torch.no_grad():
        logits = smol.model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].float()
    expected = torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert (torch.tensor(out.logprobs) - expected).abs().max().item() < 1e-3


def test_top_k_one_equals_greedy(smol, chat_prompt):
    prompt = chat_prompt("Name three fruits.")
    greedy, top1 = generate(smol, (prompt, Sampling(max_tokens=10, temperature=0.0, seed=1)),
                            (prompt, Sampling(max_tokens=10, temperature=1.0, top_k=1, seed=2)))
    assert top1.token_ids == greedy.token_ids
    assert top1.logprobs == pytest.approx(greedy.logprobs, abs=1e-4)


# -- seeds and batching -------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine_name", ["tiny", "smol"])
def test_per_request_seed_gives_the_same_tokens_whatever_else_is_in_the_batch(request, engine_name, chat_prompt):
    engine = request.getfixturevalue(engine_name)
    target = chat_prompt("Tell me a fact about cats.")
    sampling = Sampling(max_tokens=16, temperature=1.0, seed=1234, stop_token_ids=())
    alone, = generate(engine, (target, sampling))
    others = [(p, Sampling(max_tokens=n, temperature=0.8, seed=n, top_p=0.9 if n == 20 else 1.0))   # a top-p
              for p, n in zip(PROMPTS, (5, 20, 9, 3))]                                           # step variant
    batched = generate(engine, others[0], others[1], (target, sampling), others[2], others[3])[2]
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == pytest.approx(alone.logprobs, abs=1e-3)
    other_seed, = generate(engine, (target, sampling.with_(seed=4321)))
    assert other_seed.token_ids != alone.token_ids


def test_a_request_joining_a_running_batch_gets_the_same_tokens_as_alone(tiny):
    long = (PROMPTS[2], Sampling(max_tokens=40, temperature=1.0, seed=11))
    late = (PROMPTS[0], Sampling(max_tokens=8, temperature=1.0, seed=12))
    alone_long, = generate(tiny, long)
    alone_late, = generate(tiny, late)

    async def staggered():
        first = asyncio.create_task(tiny.generate(*long))
        start = tiny.stats["decode_steps"]
        while tiny.stats["decode_steps"] < start + 1:   # decoding, 39 steps to go (longer: batch float noise
            await asyncio.sleep(0.001)                   # flips temperature-1 samples more often)
        second = await tiny.generate(*late)
        assert not first.done()
        return await first, second
    together_long, together_late = asyncio.run(staggered())
    assert together_long.token_ids == alone_long.token_ids and together_late.token_ids == alone_late.token_ids


def test_more_requests_than_slots_reuse_freed_slots(torch_threads):
    with torch_threads(1):
        engine = make_engine(prepare("tiny-random"), max_batch_size=2, gather_ms=0)
    try:
        requests = [(p + [i], Sampling(max_tokens=3 + 2 * i, temperature=1.0, seed=i))
                    for i, p in enumerate(PROMPTS * 2)]
        before = dict(engine.stats)
        together = generate(engine, *requests)
        stats = {k: v - before[k] for k, v in engine.stats.items() if k in before}
        assert stats["requests"] == len(requests)     # two slots: admitted over several admissions
        assert 2 <= stats["admissions"] <= len(requests)
        assert 0 < stats["admit_s"] < stats["busy_s"] and 0 <= stats["wait_s"] < stats["busy_s"]
        for request, out in zip(requests, together):
            assert out.token_ids == generate(engine, request)[0].token_ids
            assert len(out.token_ids) == request[1].max_tokens and out.finish_reason == "length"
    finally:
        asyncio.run(engine.close())


# -- finishing ------------------------------------------------------------------------------------------------
def test_stop_token_ends_with_stop_and_is_included_length_otherwise(smol, chat_prompt):
    prompt = chat_prompt("Say hello.")
    stopped, cut, one = generate(smol, (prompt, Sampling(max_tokens=40, temperature=0.0, stop_token_ids=(IM_END,))),
                                 (prompt, Sampling(max_tokens=3, temperature=0.0, stop_token_ids=(IM_END,))),
                                 (prompt, Sampling(max_tokens=1, temperature=0.0)))
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == IM_END
    assert IM_END not in stopped.token_ids[:-1] and len(stopped.logprobs) == len(stopped.token_ids)
    assert cut.finish_reason == "length" and cut.token_ids == stopped.token_ids[:3]
    assert one.finish_reason == "length" and one.token_ids == stopped.token_ids[:1]


def test_max_tokens_is_capped_by_the_slot_length_and_bad_requests_fail(tiny):
    out, = generate(tiny, ([5] * 250, Sampling(max_tokens=100, temperature=1.0, seed=0)))
    assert out.finish_reason == "length" and len(out.token_ids) == 256 - 250
    with pytest.raises(EngineError, match="no room in max_len 256"):
        generate(tiny, ([5] * 256, Sampling(max_tokens=1)))
    with pytest.raises(EngineError, match="at most 8"):
        generate(tiny, ([5], Sampling(max_tokens=1, stop_token_ids=tuple(range(9)))))
    with pytest.raises(EngineError, match="empty prompt"):
        generate(tiny, ([], Sampling(max_tokens=1)))
    with pytest.raises(EngineError, match="max_tokens must be at least 1"):
        generate(tiny, ([1], Sampling(max_tokens=0)))


# -- control ------------------------------------------------------------------------------------------------
def test_cancelling_a_request_frees_its_slot(tiny):
    async def scenario():
        task = asyncio.create_task(tiny.generate(PROMPTS[0], Sampling(max_tokens=240)))
        start = tiny.stats["decode_steps"]
        while tiny.stats["decode_steps"] < start + 3:
            await asyncio.sleep(0.002)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await tiny.generate(PROMPTS[1], Sampling(max_tokens=4, seed=3))
    after = asyncio.run(scenario())
    assert len(after.token_ids) == 4
    asyncio.run(asyncio.sleep(0.05))
    assert not tiny._occupied and sorted(tiny.slots.empty + list(tiny.slots.parked)) == list(range(8))


def test_update_weights_in_place_changes_outputs_and_accepts_tied_names(tiny):
    sampling = Sampling(max_tokens=8, temperature=0.0)
    before, = generate(tiny, (PROMPTS[3], sampling))
    original = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    assert "lm_head.weight" in original
    changed = {k: v + 0.5 * torch.randn_like(v) if v.is_floating_point() else v for k, v in original.items()}
    asyncio.run(tiny.update_weights(changed.items(), version=3))
    after, = generate(tiny, (PROMPTS[3], sampling))
    assert tiny.version == 3 and after.token_ids != before.token_ids
    assert after.token_ids == reference_greedy(tiny.model, PROMPTS[3], 8)    # the decoder reads the new tensors
    asyncio.run(tiny.update_weights(original.items(), version=4))
    assert generate(tiny, (PROMPTS[3], sampling))[0].token_ids == before.token_ids
    with pytest.raises(EngineError, match="no parameter 'nope.weight'"):
        asyncio.run(tiny.update_weights([("nope.weight", torch.zeros(1))], version=5))


def test_close_fails_requests_in_flight(torch_threads):
    with torch_threads(1):
        engine = make_engine(prepare("tiny-random"), gather_ms=0, max_len=4096)

    async def close_while_busy():
        task = asyncio.create_task(engine.generate(PROMPTS[0], Sampling(max_tokens=4000, stop_token_ids=())))
        while engine.stats["decode_steps"] < 3:     # decoding, with thousands of steps to go
            await asyncio.sleep(0.002)
        await engine.close()
        with pytest.raises(EngineError, match="engine closed"):
            await task
        with pytest.raises(EngineError, match="engine is closed"):
            await engine.generate([1, 2], Sampling(max_tokens=2))
    asyncio.run(close_while_busy())


# -- selection ------------------------------------------------------------------------------------------------
def test_build_hf_engine_picks_by_engine_fast(torch_threads):
    from transformers import GPT2Config, GPT2LMHeadModel

    path = str(prepare("tiny-random"))
    common = dict(device="cpu", dtype="float32", max_batch_size=2, max_len=64, gather_ms=0, seed=0)
    with torch_threads(1):
        auto = build_hf_engine(path, "auto", **common)       # auto: the fast engine only on CUDA
        on = build_hf_engine(path, "on", **common)
    try:
        assert type(auto) is HFEngine and type(on) is FastEngine
    finally:
        asyncio.run(auto.close())
        asyncio.run(on.close())
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    assert "model type 'gpt2'" in unsupported_reason(gpt2, 64)
    with pytest.raises(ValueError, match="does not support this model: model type 'gpt2'"):
        FastEngine("", device="cpu", dtype="float32", model=gpt2)


def test_a_step_piece_that_fails_to_compile_runs_uncompiled():
    from turnrl.engines.fast.step import Compiled

    notes = []
    piece = Compiled("finish", lambda x: x + torch.tensor(x.tolist()), notes)   # .tolist(): no full graph
    assert torch.equal(piece(torch.ones(2)), torch.full((2,), 2.0))
    assert piece.compiled is None and notes[0].startswith("torch.compile failed on 'finish'")
    assert torch.equal(piece(torch.ones(3)), torch.full((3,), 2.0)) and len(notes) == 1


# -- sampling -------------------------------------------------------------------------------------------------
def test_uniforms_depend_only_on_key_and_counter_and_look_uniform():
    keys = torch.tensor([seed_key(s) for s in range(300)])
    counters = torch.arange(300)
    u = uniform(keys[:, None].expand(300, 300), counters[None, :].expand(300, 300))
    assert torch.equal(u[7], uniform(keys[7].expand(300), counters))
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    histogram = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (histogram - 0.1).abs().max() < 0.01
    assert seed_key(-1) != seed_key(2**64 - 2) and seed_key(-1) == seed_key(2**64 - 1)


def test_inverse_cdf_sampling_follows_the_distribution_and_logprobs_ignore_truncation():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    n = 20000
    logits = probs.log().expand(n, 4)
    ones, zeros = torch.ones(n), torch.zeros(n, dtype=torch.long)
    tokens, logprobs = sample(logits, ones, torch.full((n,), seed_key(7)), torch.arange(n), zeros, ones, False)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert (freq - probs).abs().max() < 0.015 and freq[3] == 0
    assert torch.allclose(logprobs, probs.log()[tokens])
    top_p = torch.full((n,), 0.6)
    nucleus, logprobs = sample(logits, ones, torch.full((n,), seed_key(7)), torch.arange(n), zeros, top_p, True)
    assert set(nucleus.tolist()) == {0, 1} and torch.allclose(logprobs, probs.log()[nucleus])
    top1, _ = sample(logits, ones, torch.full((n,), seed_key(7)), torch.arange(n), torch.ones(n, dtype=torch.long),
                     ones, True)
    assert set(top1.tolist()) == {0}
    untouched, _ = sample(logits, ones, torch.full((n,), seed_key(7)), torch.arange(n), zeros, ones, True)
    assert torch.equal(untouched, tokens)                    # rows without top-k/top-p: same as the plain step
    greedy, greedy_lp = sample(logits[:2], torch.zeros(2), zeros[:2], zeros[:2], zeros[:2], ones[:2], False)
    assert greedy.tolist() == [0, 0] and torch.allclose(greedy_lp, torch.log(torch.tensor([0.5, 0.5])))


# -- GPU: CUDA graphs and torch.compile against the eager path --------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def shape_model(dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    from turnrl.bench.train import SHAPES
    with torch.random.fork_rng(devices=[]), torch.device("cuda"):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**SHAPES["tiny-shape"]), dtype=dtype).eval()


def gpu_requests():
    return [([3 + i] * (5 + 7 * i), Sampling(max_tokens=20 + i, temperature=[0.0, 1.0, 0.7][i % 3], seed=i,
                                             top_p=0.8 if i == 4 else 1.0)) for i in range(10)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_graph_steps_match_eager_steps_and_a_full_forward(compile):
    model = shape_model(torch.float32)
    eager = FastEngine("", device="cuda", dtype="float32", model=model, max_batch_size=16, max_len=256,
                       cuda_graphs=False, compile=False)
    fast = FastEngine("", device="cuda", dtype="float32", model=model, max_batch_size=16, max_len=256,
                      cuda_graphs=True, compile=compile)
    try:
        reference = generate(eager, *gpu_requests())
        first = generate(fast, *gpu_requests())
        again = generate(fast, *gpu_requests())                      # replays the captured graphs
        assert fast.stats["graphs"] > 0 and fast.stats["graph_replays"] > 0 and not fast.notes
        for ref, out, out2, (prompt, sampling) in zip(reference, first, again, gpu_requests()):
            assert out.token_ids == out2.token_ids
            assert out.token_ids == ref.token_ids if not compile else len(out.token_ids) == sampling.max_tokens
            with torch.no_grad():
                logits = model(torch.tensor([prompt + out.token_ids], device="cuda")).logits[0, len(prompt) - 1:-1]
            temperature = sampling.temperature or 1.0
            expected = torch.log_softmax(logits.float() / temperature, -1)
            chosen = expected.gather(1, torch.tensor(out.token_ids, device="cuda")[:, None])[:, 0]
            assert (chosen.cpu() - torch.tensor(out.logprobs)).abs().max() < 1e-3
            if sampling.temperature == 0:                               # greedy: the argmax, up to ties
                assert (expected.max(-1).values - chosen).max() < 1e-4
    finally:
        asyncio.run(eager.close())
        asyncio.run(fast.close())


@pytest.mark.gpu
@gpu
def test_gpu_seeded_samples_ignore_the_batch_and_weights_update_under_graphs():
    model = shape_model(torch.bfloat16)
    engine = FastEngine("", device="cuda", dtype="bfloat16", model=model, max_batch_size=16, max_len=256)
    try:
        target = ([7] * 30, Sampling(max_tokens=24, temperature=1.0, seed=99))
        alone, = generate(engine, target)
        batched = generate(engine, *gpu_requests()[:5], target, *gpu_requests()[5:])[5]
        assert batched.token_ids == alone.token_ids
        greedy = ([9] * 12, Sampling(max_tokens=12, temperature=0.0))
        before, = generate(engine, greedy)
        original = {k: v.clone() for k, v in model.state_dict().items()}
        torch.manual_seed(0)
        changed = {k: v + 0.5 * torch.randn_like(v) if v.is_floating_point() else v for k, v in original.items()}
        asyncio.run(engine.update_weights(changed.items(), version=1))
        after, = generate(engine, greedy)
        asyncio.run(engine.update_weights(original.items(), version=2))
        restored, = generate(engine, greedy)
        assert after.token_ids != before.token_ids and restored.token_ids == before.token_ids
        assert engine.stats["graph_replays"] > 0
    finally:
        asyncio.run(engine.close())


@pytest.mark.gpu
@gpu
def test_gpu_rotary_inside_the_kernels_decodes_as_a_rotary_kernel_does():
    """bf16 on CUDA: the rotary embedding runs inside the cache-write and attention kernels by default; the
    tokens it samples have the logprobs of a full forward pass, as with the rotary in its own kernel."""
    model = shape_model(torch.bfloat16)
    inside = FastEngine("", device="cuda", dtype="bfloat16", model=model, max_batch_size=16, max_len=256)
    apart = FastEngine("", device="cuda", dtype="bfloat16", model=model, max_batch_size=16, max_len=256,
                       fused_rope=False)
    try:
        assert inside.step.fused_rope and not apart.step.fused_rope and not inside.notes
        for engine in (inside, apart):
            for out, (prompt, sampling) in zip(generate(engine, *gpu_requests()), gpu_requests()):
                with torch.no_grad():
                    ids = torch.tensor([prompt + out.token_ids], device="cuda")
                    logits = model(ids).logits[0, len(prompt) - 1:-1].float() / (sampling.temperature or 1.0)
                chosen = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None])[:, 0]
                assert (chosen.cpu() - torch.tensor(out.logprobs)).abs().max() < 0.15   # bf16 kernels differ
    finally:
        asyncio.run(inside.close())
        asyncio.run(apart.close())
