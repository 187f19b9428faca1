"""engine.exact on the slot engine: a request's tokens and logprobs do not depend on its batch-mates or on when
it was admitted, and they equal, bit for bit, the trainer's exact forward (`turnrl.exact.model.exact_logprobs`)
on the float32 master weights cast to the engine's dtype. On the CPU here; the same checks run in bf16 on a
GPU with the Qwen2.5-0.5B shape (`gpu`-marked, skipped without one)."""

import asyncio
import copy
import random

import pytest
import torch

from turnrl.engines.base import EngineError, Sampling
from turnrl.engines.fast import FastEngine, build_hf_engine
from turnrl.exact.model import exact_logprobs
from turnrl.models import prepare

TARGET = (list(range(40, 77)), Sampling(max_tokens=16, temperature=1.0, seed=99))


def mixed(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], Sampling]]:
    rnd = random.Random(seed)
    return [([rnd.randrange(3, vocab) for _ in range(rnd.randrange(2, 90))],
             Sampling(max_tokens=rnd.randrange(1, 24), temperature=rnd.choice([0.0, 0.7, 1.0]), seed=seed * 1000 + i))
            for i in range(n)]


def generate(engine, requests, stagger_s: float = 0.0):
    async def one(i, prompt, sampling):
        await asyncio.sleep(i * stagger_s)        # admitted at different times, into a running batch
        return await engine.generate(prompt, sampling)

    async def main():
        return await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(requests)))
    return asyncio.run(main())


def trainer_logprobs(policy, requests, outs, dtype):
    """The trainer's logprobs of every completion, all rows in one right-padded batch."""
    rows = [p + o.token_ids for (p, _), o in zip(requests, outs)]
    width = max(map(len, rows))
    device = next(policy.parameters()).device
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    pos = torch.arange(width, device=device).expand(len(rows), width)
    temps = {s.temperature or 1.0 for _, s in requests}
    got = []
    with torch.no_grad():
        per_temp = {t: exact_logprobs(policy, ids, mask, pos, t, dtype)[0] for t in temps}
    for i, ((prompt, s), o) in enumerate(zip(requests, outs)):
        lp = per_temp[s.temperature or 1.0][i, len(prompt):len(prompt) + len(o.token_ids)]
        got.append(lp.tolist())
    return got


def check_exact(policy, device: str, dtype: torch.dtype, n: int, max_len: int = 512):
    """The target alone, then inside n - 1 mixed requests admitted over time: identical tokens and logprobs,
    and every completion's logprobs equal the trainer's."""
    model = copy.deepcopy(policy).to(device, dtype)
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    engine = FastEngine("", device=device, dtype=name, model=model, max_batch_size=64, max_len=max_len, exact=True)
    try:
        alone, = generate(engine, [TARGET])
        others = mixed(n - 1, policy.config.vocab_size)
        requests = others[:n // 2] + [TARGET] + others[n // 2:]
        outs = generate(engine, requests, stagger_s=0.002)
        again = generate(engine, list(reversed(requests)))[::-1]      # other slots, other batch-mates
    finally:
        asyncio.run(engine.close())
    inside = outs[n // 2]
    assert len(alone.token_ids) == 16
    assert inside.token_ids == alone.token_ids and inside.logprobs == alone.logprobs
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert [o.logprobs for o in again] == [o.logprobs for o in outs]
    policy = policy.to(device)
    expected = trainer_logprobs(policy, requests, outs, dtype)
    worst = max(max((abs(a - b) for a, b in zip(e, o.logprobs)), default=0.0) for e, o in zip(expected, outs))
    assert worst == 0.0, f"engine and trainer logprobs differ by up to {worst}"
    return outs


@pytest.fixture(scope="module")
def tiny_policy():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(prepare("tiny-random")), dtype=torch.float32)


def test_a_request_alone_and_inside_64_mixed_requests_float32(tiny_policy, torch_threads):
    with torch_threads(1):
        check_exact(tiny_policy, "cpu", torch.float32, 64)


def test_bf16_engine_equals_the_trainer_on_bf16_casts_of_the_master_weights(tiny_policy, torch_threads):
    with torch_threads(1):
        check_exact(tiny_policy, "cpu", torch.bfloat16, 12)


@pytest.mark.slow
def test_real_model_alone_and_in_a_batch(smollm2_dir, torch_threads):
    from transformers import AutoModelForCausalLM
    policy = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    with torch_threads(1):
        check_exact(policy, "cpu", torch.float32, 4)


def test_switch_selects_the_exact_slot_engine_and_rejects_truncation(torch_threads):
    with torch_threads(1):
        engine = build_hf_engine(str(prepare("tiny-random")), "auto", device="cpu", dtype="float32", max_batch_size=4,
                                 max_len=256, gather_ms=0, seed=0, exact=True)
        try:
            assert isinstance(engine, FastEngine) and engine.exact and not engine.step.units["pre"].__class__.__name__ == "Compiled"
            with pytest.raises(EngineError, match="top_p=1"):
                asyncio.run(engine.generate([1, 2, 3], Sampling(max_tokens=2, top_p=0.9)))
        finally:
            asyncio.run(engine.close())
    with pytest.raises(ValueError, match="fast=auto or on"):
        build_hf_engine(str(prepare("tiny-random")), "off", device="cpu", dtype="float32", max_batch_size=4,
                        max_len=256, gather_ms=0, seed=0, exact=True)


# -- GPU: the same in bf16 with the Qwen2.5-0.5B shape, CUDA graphs on --------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_gpu_bf16_alone_and_inside_64_mixed_requests_equal_the_trainer():
    from transformers import AutoConfig, AutoModelForCausalLM

    from turnrl.bench.train import SHAPES
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        policy = AutoModelForCausalLM.from_config(AutoConfig.for_model(**SHAPES["qwen2.5-0.5b-shape"]),
                                                  dtype=torch.float32)
    check_exact(policy, "cuda", torch.bfloat16, 64, max_len=1024)
