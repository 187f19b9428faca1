"""The engine contract (`turnrl.engines.base.Engine`), one suite over every engine: the plain HF engine and
the fast engine on the CPU (tiny random model), the fast engine on a GPU (`gpu`-marked, skipped without one),
and in-process vLLM (SmolLM2, CPU build). Each engine declares what it can do in `capabilities`; what it does
not have raises `EngineError`, so no caller needs to probe attributes."""

import asyncio
import math
import os

import pytest
import torch

from turnrl.config.schema import EngineConfig
from turnrl.engines.base import Capabilities, Completion, Engine, EngineBase, EngineError, Sampling
from turnrl.models import prepare
from turnrl.rollout.factory import build_engine

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # vLLM in this process (before its import)
CUDA = torch.cuda.is_available()
ENGINES = [
    pytest.param("hf", id="hf"),
    pytest.param("fast", id="fast-cpu"),
    pytest.param("fast-cuda", id="fast-cuda", marks=[pytest.mark.gpu,
                                                     pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]),
    pytest.param("vllm", id="vllm"),
]


def make(kind: str, smollm2_dir) -> Engine:
    if kind == "vllm":
        pytest.importorskip("vllm")
        return build_engine(EngineConfig(kind="vllm", max_model_len=1024, cpu_kv_cache_gb=0.5, max_num_seqs=8),
                            smollm2_dir)
    device = "cuda" if kind == "fast-cuda" else "cpu"
    return build_engine(EngineConfig(kind="hf", device=device, dtype="float32", gather_ms=1.0,
                                     fast="off" if kind == "hf" else "on"), prepare("tiny-random"))


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, smollm2_dir, torch_threads):
    with torch_threads(1):
        engine = make(request.param, smollm2_dir)
        yield engine
    if not engine_closed(engine):
        asyncio.run(engine.close())


def engine_closed(engine) -> bool:
    return bool(engine.__dict__.get("_contract_closed"))


def run(coro):
    return asyncio.run(coro)


PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def test_the_contract_is_declared(engine):
    assert isinstance(engine, EngineBase)
    assert isinstance(engine.capabilities, Capabilities)
    assert isinstance(engine.in_flight, int) and isinstance(engine.stats, dict)
    assert engine.model is None or isinstance(engine.model, torch.nn.Module)
    assert engine.device is None or isinstance(engine.device, torch.device)


def test_generate_returns_one_finite_logprob_per_token_within_max_tokens(engine):
    out = run(engine.generate(PROMPT, Sampling(max_tokens=5, temperature=1.0, seed=7)))
    assert isinstance(out, Completion) and out.finish_reason in ("stop", "length")
    assert 1 <= len(out.token_ids) <= 5 and len(out.logprobs) == len(out.token_ids)
    assert all(math.isfinite(x) and x <= 1e-6 for x in out.logprobs)
    assert engine.in_flight == 0


def test_a_stop_token_ends_the_completion_and_length_is_reported(engine):
    free = run(engine.generate(PROMPT, Sampling(max_tokens=6, temperature=0.0)))
    if free.finish_reason == "length":
        assert len(free.token_ids) == 6
    stop = free.token_ids[2]
    cut = run(engine.generate(PROMPT, Sampling(max_tokens=6, temperature=0.0, stop_token_ids=(stop,))))
    first = free.token_ids.index(stop)
    assert cut.token_ids == free.token_ids[: first + 1] and cut.finish_reason == "stop"


def test_a_seeded_request_repeats_even_after_the_prefix_cache_is_reset(engine):
    sampling = Sampling(max_tokens=6, temperature=1.0, seed=1234)
    first = run(engine.generate(PROMPT, sampling))
    run(engine.reset_prefix_cache())
    again = run(engine.generate(PROMPT, sampling))
    assert again.token_ids == first.token_ids
    assert again.logprobs == pytest.approx(first.logprobs, abs=1e-4)


def test_stream_yields_the_same_tokens_as_generate(engine):
    """`stream`: Deltas (one per step where the engine streams, none where it does not), then the Completion,
    whose tokens the deltas add up to and which a plain `generate` with the same seed also samples."""
    from turnrl.engines.base import Delta
    sampling = Sampling(max_tokens=6, temperature=1.0, seed=99)
    plain = run(engine.generate(PROMPT, sampling))

    async def go():
        return [item async for item in engine.stream(PROMPT, sampling)]
    items = run(go())
    deltas, done = items[:-1], items[-1]
    assert all(isinstance(d, Delta) for d in deltas) and isinstance(done, Completion)
    assert done.token_ids == plain.token_ids and done.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    if engine.capabilities.streaming:
        assert len(deltas) >= 2 and [t for d in deltas for t in d.token_ids] == done.token_ids
    else:
        assert deltas == []
    assert engine.in_flight == 0


def test_what_an_engine_lacks_raises_engine_error(engine):
    caps = engine.capabilities
    if not caps.lora_adapters:
        with pytest.raises(EngineError):
            run(engine.update_lora({}, {}, 1))
    if not caps.sleep:
        with pytest.raises(EngineError):
            run(engine.sleep())
        with pytest.raises(EngineError):
            run(engine.wake_up())


def test_bad_requests_are_engine_errors(engine):
    with pytest.raises(EngineError):
        run(engine.generate([], Sampling(max_tokens=4)))


def test_z_a_closed_engine_refuses_requests(engine):
    run(engine.close())
    engine.__dict__["_contract_closed"] = True
    with pytest.raises(EngineError):
        run(engine.generate(PROMPT, Sampling(max_tokens=2)))
