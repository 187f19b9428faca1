"""The transformers engine's lean CPU decode step: bit-identical to the model's forward, or not used at all; with
the skinny kernel for its products, within float32 rounding of it."""

import asyncio
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

import turnrl.engines.cpu_decode as cpu_decode
from turnrl.engines import cpu_gemm
from turnrl.engines.base import Sampling
from turnrl.engines.hf import HFEngine, new_cache
from turnrl.models import resolve


def engine(model=None, lean=True, dtype="float32", gemm=False):
    e = HFEngine(str(resolve("tiny-random")), device="cpu", dtype=dtype, model=model, max_batch_size=8, gather_ms=30,
                 cpu_gemm=gemm)
    if not lean:
        e.lean = None
    return e


def run(e, asks):
    async def go():
        return await asyncio.gather(*(e.generate(p, s) for p, s in asks))
    try:
        return asyncio.run(go())
    finally:
        asyncio.run(e.close())


def asks():
    """Rows of different lengths (left padding), sampled and greedy, two of them sharing a prompt."""
    prompts = [list(range(5, 5 + n)) for n in (3, 9, 17, 17)] + [[40, 41, 42, 43, 44]]
    return [(p, Sampling(max_tokens=12, temperature=0.0 if i == 1 else 1.0, seed=i, stop_token_ids=()))
            for i, p in enumerate(prompts)]


def tiny(config_class, **extra):
    torch.manual_seed(0)
    cfg = config_class(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **extra)
    return AutoModelForCausalLM.from_config(cfg).to(torch.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_samples_the_same_tokens_and_logprobs_with_the_lean_step(torch_threads, dtype):
    with torch_threads(1):
        lean, plain = engine(dtype=dtype), engine(lean=False, dtype=dtype)
        assert lean.lean is not None and plain.lean is None
        a, b = run(lean, asks()), run(plain, asks())
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.logprobs == y.logprobs     # bit for bit
    assert lean.stats["decode_steps"] == plain.stats["decode_steps"] > 0


def test_qwen2_biases_are_covered(torch_threads):
    with torch_threads(1):
        model = tiny(Qwen2Config)
        assert model.model.layers[0].self_attn.q_proj.bias is not None
        lean, plain = engine(model), engine(tiny(Qwen2Config), lean=False)
        assert lean.lean is not None
        for x, y in zip(run(lean, asks()), run(plain, asks())):
            assert x.token_ids == y.token_ids and x.logprobs == y.logprobs


def test_unsupported_models_keep_the_model_s_forward(torch_threads):
    assert "is not one of" in cpu_decode.unsupported(SimpleNamespace(config=SimpleNamespace(model_type="gpt2")))
    with torch_threads(1):
        qwen3 = tiny(Qwen3Config, head_dim=16)
        assert "is not one of" in cpu_decode.unsupported(qwen3)
        assert engine(qwen3).lean is None
        scaled = tiny(Qwen2Config, rope_scaling={"rope_type": "linear", "factor": 2.0})
        assert "scaled" in cpu_decode.unsupported(scaled)


def test_a_step_that_differs_from_the_forward_is_refused(torch_threads, monkeypatch):
    step = cpu_decode.LeanDecode.__call__
    monkeypatch.setattr(cpu_decode.LeanDecode, "__call__", lambda self, *a: step(self, *a) * (1 + 1e-6))
    with torch_threads(1):
        e = engine()
        lean, why = cpu_decode.lean_decode(e.model, lambda: new_cache(e.model.config))
        asyncio.run(e.close())
    assert lean is None and "differ" in why and e.lean is None


def test_weight_updates_reach_the_lean_step(torch_threads):
    async def updated(e):
        name, weight = next((n, p) for n, p in e.model.named_parameters() if n.endswith("layers.0.mlp.up_proj.weight"))
        await e.update_weights([(name, weight * 1.5)], version=1)
        return await asyncio.gather(*(e.generate(p, s) for p, s in asks()))

    with torch_threads(1):
        lean, plain = engine(), engine(lean=False)
        before = run(engine(), asks())
        a, b = asyncio.run(updated(lean)), asyncio.run(updated(plain))
        for e in (lean, plain):
            asyncio.run(e.close())
    assert [x.logprobs for x in a] == [y.logprobs for y in b]
    assert [x.logprobs for x in a] != [y.logprobs for y in before]     # the update changed what the step computes


def kernel_or_skip():
    if not cpu_gemm.avx512():
        pytest.skip("the engine uses the skinny kernel only on AVX-512 CPUs")
    kernel, why = cpu_gemm.load()
    if kernel is None:
        pytest.skip(f"the kernel does not build here: {why}")


def test_the_kernel_step_samples_the_same_tokens_within_float32_rounding(torch_threads):
    kernel_or_skip()
    with torch_threads(1):
        fast, plain = engine(gemm=True), engine(lean=False)
        assert fast.lean is not None and fast.lean.linear is not torch.nn.functional.linear
        a, b = run(fast, asks()), run(plain, asks())
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4
    assert any(x.logprobs != y.logprobs for x, y in zip(a, b))     # the kernel's own sums, not linear's


def test_a_kernel_step_too_far_from_the_forward_falls_back_to_linear(torch_threads, monkeypatch):
    kernel_or_skip()
    kernel, _ = cpu_gemm.load()
    off = lambda x, w, b=None: kernel(x, w, b) * (1 + 1e-3)   # noqa: E731
    monkeypatch.setattr(cpu_decode, "kernel_for", lambda model: (off, ""))
    with torch_threads(1):
        e = engine(gemm=True)
        asyncio.run(e.close())
    assert e.lean is not None and e.lean.linear is torch.nn.functional.linear


def test_the_kernel_is_not_asked_for_bf16_models(torch_threads):
    with torch_threads(1):
        e = engine(dtype="bfloat16", gemm=True)
        asyncio.run(e.close())
    assert e.lean is not None and e.lean.linear is torch.nn.functional.linear
    assert "bfloat16" in cpu_decode.kernel_for(e.model)[1]
