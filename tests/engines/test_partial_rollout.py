"""Partial rollouts on the real engines (SmolLM2 on the CPU): new weights arrive while a request decodes; with
`partial_rollout` the request is interrupted, returns what the old weights sampled, and `engines.resume`
continues it on the new weights from a fresh prefill of the whole context.

Checked against transformers recomputations: the tokens before the interruption carry the old weights'
logprobs, those after it the new weights' given the whole prefix (float32: to 1e-4; vLLM's bf16: within its
usual noise). Without `partial_rollout` the hf engine goes on decoding over the old weights' KV cache, and the
tokens after the update match neither policy: the contrast shows the check can fail.
"""

import asyncio
import copy
import os

import pytest
import torch

from turnrl.config.schema import RolloutConfig, SamplingConfig
from turnrl.data import load_dataset
from turnrl.engines.base import Sampling
from turnrl.engines.fast.engine import FastEngine
from turnrl.engines.hf import HFEngine
from turnrl.engines import resume
from turnrl.rollout.factory import build_environment, build_loop, load_template
from turnrl.rollout.scheduler import run_batch
from turnrl.train.policy import export_weights, forward_logprobs

TOKENS = 40


@pytest.fixture(scope="module")
def models(smollm2_dir):
    from transformers import AutoModelForCausalLM
    old = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    new = copy.deepcopy(old)
    with torch.no_grad():
        for layer in new.model.layers:
            layer.mlp.down_proj.weight.mul_(0.5)
    return old, new


@pytest.fixture(scope="module")
def template(smollm2_dir):
    return load_template(smollm2_dir)


@pytest.fixture(scope="module")
def prompt(template):
    task = load_dataset(task="calculator", size=1, seed=4, options={"demo": True})[0]
    return template.encode(template.render(task.messages, None, True))


def recompute(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp, _ = forward_logprobs(model, ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None], 1.0)
    return lp[0, len(prompt):]


async def until(condition, timeout_s=120.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the engine made no progress"
        await asyncio.sleep(0.005)


async def update_midway(engine, prompt, new, progressed):
    """Greedy request of TOKENS tokens (no stop token); new weights (version 1) once `progressed()`."""
    task = asyncio.ensure_future(resume.generate(engine, prompt, Sampling(max_tokens=TOKENS, temperature=0.0)))
    await until(progressed)
    assert not task.done(), "the request finished before the update: make it longer"
    await engine.update_weights(export_weights(new), version=1)
    return await task


def check_split(out, prompt, models, atol, mean_atol=None):
    """Tokens before the interruption: the old weights'; after it: the new weights', given the whole prefix
    (each side's largest difference under `atol`, and its mean under `mean_atol` where given)."""
    old, new = models
    c = out.completion
    assert c.finish_reason == "length" and len(c.token_ids) == TOKENS
    assert out.interruptions == 1 and [v for _, v in out.versions] == [0, 1] and c.version == 0
    k = out.versions[1][0]
    assert 0 < k < TOKENS
    got = torch.tensor(c.logprobs)
    by_old, by_new = recompute(old, prompt, c.token_ids), recompute(new, prompt, c.token_ids)
    head, tail = (got[:k] - by_old[:k]).abs(), (got[k:] - by_new[k:]).abs()
    assert head.max() < atol and tail.max() < atol, (head.max(), tail.max())
    if mean_atol is not None:
        assert head.mean() < mean_atol and tail.mean() < mean_atol, (head.mean(), tail.mean())
    return k, (got[k:] - by_old[k:]).abs().max()


def engines():
    return {"hf": lambda model, **kw: HFEngine("", device="cpu", dtype="float32", model=model, gather_ms=0, **kw),
            "fast": lambda model, **kw: FastEngine("", device="cpu", dtype="float32", model=model, max_len=1024,
                                                   gather_ms=0, max_batch_size=8, **kw)}


@pytest.mark.parametrize("kind", ["hf", "fast"])
def test_an_interrupted_request_resumes_on_the_new_weights(kind, models, prompt, torch_threads):
    with torch_threads(1):
        engine = engines()[kind](copy.deepcopy(models[0]), partial_rollout=True)
        try:
            out = asyncio.run(update_midway(engine, prompt, models[1], lambda: engine.stats["decode_steps"] >= 8))
        finally:
            asyncio.run(engine.close())
    k, off_old = check_split(out, prompt, models, atol=1e-4)
    assert off_old > 0.05                # the two policies differ where the new one sampled
    assert engine.stats["interrupted"] == 1


def test_without_partial_rollouts_the_update_leaves_stale_kv(models, prompt, torch_threads):
    with torch_threads(1):
        engine = engines()["hf"](copy.deepcopy(models[0]))
        try:
            out = asyncio.run(update_midway(engine, prompt, models[1], lambda: engine.stats["decode_steps"] >= 8))
        finally:
            asyncio.run(engine.close())
    c = out.completion
    assert out.interruptions == 0 and c.finish_reason == "length" and c.version == 0
    old, new = models
    got = torch.tensor(c.logprobs)
    # the tokens decoded after the update match neither the old weights nor the new ones on the whole prefix
    late = slice(TOKENS - 8, TOKENS)
    assert (got[late] - recompute(new, prompt, c.token_ids)[late]).abs().max() > 1e-2
    assert (got[late] - recompute(old, prompt, c.token_ids)[late]).abs().max() > 1e-2


def test_the_agent_loop_records_each_token_s_version(models, template, torch_threads):
    """A batch through the loop with new weights mid-way: every ledger checks, each turn's versions cover its
    tokens, and an interrupted turn carries both versions."""
    cfg = RolloutConfig(n=2, max_assistant_turns=2, max_response_tokens=200,
                        sampling=SamplingConfig(temperature=0.8, max_tokens_per_turn=48))
    tasks = load_dataset(task="calculator", size=2, seed=1, options={"demo": True})
    with torch_threads(1):
        engine = engines()["hf"](copy.deepcopy(models[0]), partial_rollout=True)
        loop = build_loop(cfg, engine, template, build_environment(cfg), seed=3)

        async def go():
            batch = asyncio.ensure_future(run_batch(loop, tasks, 2, concurrency=4))
            await until(lambda: engine.stats["decode_steps"] >= 10)
            await engine.update_weights(export_weights(models[1]), version=1)
            return await batch
        try:
            trajs = asyncio.run(go())
        finally:
            asyncio.run(engine.close())
    interrupted = 0
    for t in trajs:
        t.check()
        assert not t.masked and t.parity in ("exact", "token_drift"), (t.errors, t.parity)
        for turn in t.turns:
            versions = turn.token_versions(default=-1)
            assert len(versions) == turn.end - turn.start and -1 not in versions
            assert versions == sorted(versions)
            interrupted += len({*versions}) == 2
        assert t.metrics.get("interruptions", 0) == sum(len(turn.versions) - 1 for turn in t.turns)
    assert interrupted >= 1 and engine.stats["interrupted"] >= 1


@pytest.mark.vllm
def test_vllm_interrupts_by_abort_and_resumes(smollm2_dir, models, prompt):
    """The in-process vLLM engine (bf16) reads each step's tokens (DELTA outputs), aborts its running requests
    at the update and hands back their tokens; the resumed piece runs on the new weights."""
    pytest.importorskip("vllm")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from turnrl.engines.vllm import VLLMEngine
    engine = VLLMEngine(str(smollm2_dir), max_model_len=1024, cpu_kv_cache_gb=1.0, seed=0, partial_rollout=True)
    try:
        out = asyncio.run(update_midway(engine, prompt, models[1],
                                        lambda: any(len(r.ids) >= 8 for r in list(engine._live.values()))))
    finally:
        asyncio.run(engine.close())
    # bf16 against float32: ~0.04 on average, ~0.1-0.15 at most as measured, but a CI run saw 0.33 on one token
    # of the perturbed policy (where the interruption falls, and so the tokens, varies between runs)
    k, off_old = check_split(out, prompt, models, atol=0.6, mean_atol=0.1)
    assert off_old > 1.0 and engine.stats["interrupted"] == 1
