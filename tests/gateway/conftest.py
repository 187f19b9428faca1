"""Gateway fixtures: a scripted engine on the real SmolLM2 tokenizer, the real HF engine, a running server.

`ScriptedEngine(template, texts)` answers its k-th finished call with texts[k] (the last one repeats; a call
cancelled first, such as a wrong guess the gateway throws away, answers nothing) tokenized with the
real tokenizer plus `<|im_end|>`, with made-up logprobs that identify the call, so a test can check which
sampled tokens ended up where in the ledger. `served(gateway)` runs the real ASGI app with uvicorn on a free
loopback port inside the test's event loop.
"""

import asyncio
import contextlib

import pytest

from turnrl.chat.parsers import get_parser
from turnrl.config.schema import EngineConfig
from turnrl.engines.base import Completion, EngineBase, Sampling
from turnrl.gateway.app import build_app
from turnrl.gateway.server import running
from turnrl.gateway.service import Defaults, Gateway

CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


class ScriptedEngine(EngineBase):
    def __init__(self, template, texts, delay=0.0):
        self.template, self.texts, self.delay = template, list(texts), delay
        self.prompts = []
        self.cancelled = 0
        self.answered = 0

    async def generate(self, prompt_ids, sampling):
        self.prompts.append(list(prompt_ids))
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        k = self.answered
        self.answered += 1
        ids = self.template.encode(self.texts[min(k, len(self.texts) - 1)]) + [self.template.stop_token_ids[0]]
        finish = "stop"
        if len(ids) > sampling.max_tokens:
            ids, finish = ids[:sampling.max_tokens], "length"
        return Completion(ids, [-(k + 1) / 100] * len(ids), finish)

    async def close(self):
        return None


@pytest.fixture
def scripted_gateway(smol_template):
    """scripted_gateway(texts, on_mismatch='split', **defaults) -> (gateway, engine)."""
    def make(texts, on_mismatch="split", delay=0.0, **defaults):
        engine = ScriptedEngine(smol_template, texts, delay)
        return Gateway(engine, smol_template, get_parser("hermes"), ["smol"], Defaults(**defaults), on_mismatch), engine
    return make


@pytest.fixture(scope="session")
def smol_hf_engine(smollm2_dir, torch_threads):
    """The real HF engine on SmolLM2 (one torch thread), shared by the gateway tests."""
    from turnrl.rollout.factory import build_engine
    with torch_threads(1):
        engine = build_engine(EngineConfig(), smollm2_dir)
        asyncio.run(engine.generate([1, 2, 3], Sampling(max_tokens=1)))
    yield engine
    asyncio.run(engine.close())


@pytest.fixture
def real_gateway(smol_hf_engine, smol_template):
    def make(on_mismatch="split", **defaults):
        return Gateway(smol_hf_engine, smol_template, get_parser("hermes"), ["smollm2"],
                       Defaults(**{"max_tokens": 24, **defaults}), on_mismatch)
    return make


@contextlib.asynccontextmanager
async def served(gateway, on_close=None):
    async with running(build_app(gateway, on_close)) as url:
        yield url


async def decoding_settled(engine, every=0.2, within=10.0):
    """Wait until the engine's generated-token count stops moving (a dropped request's last step may still
    land); returns that count."""
    tokens = engine.stats["generated_tokens"]
    for _ in range(int(within / every)):
        await asyncio.sleep(every)
        now, tokens = tokens, engine.stats["generated_tokens"]
        if now == tokens:
            break
    return tokens
