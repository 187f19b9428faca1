"""Weight payloads: LoRA adapters merged on the engine side equal the trainer's merged weights; broadcast buckets
round-trip any mix of dtypes and shapes."""

import asyncio

import pytest
import torch

from turnrl.engines.base import EngineBase
from turnrl.distributed.sync import TensorMeta, WeightPayload, apply_payload, bucket_layout


class CopyEngine(EngineBase):
    """The part of an hf engine that weight sync touches: a model and an in-place update."""

    def __init__(self, model):
        self.model = model

    async def update_weights(self, named, version):
        params = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in named:
                params[name].copy_(tensor)


@pytest.fixture(scope="module")
def tiny_dir():
    from turnrl.models import resolve
    return str(resolve("tiny-random"))


def test_an_adapter_merged_by_the_replica_equals_the_trainers_merged_weights(tiny_dir):
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    from turnrl.train.policy import export_weights, load_policy
    torch.manual_seed(0)
    policy = load_policy(tiny_dir, torch.device("cpu"), lora_rank=4, lora_alpha=8.0)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # a trained adapter (peft starts B at zero)
    adapter = {n: t.clone() for n, t in policy.state_dict().items() if "lora_" in n}
    scaling = {n: m.scaling["default"] for n, m in policy.named_modules() if isinstance(m, LoraLayer)}
    payload = WeightPayload("adapter", adapter, scaling)
    engine = CopyEngine(AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32))
    base: dict = {}
    asyncio.run(apply_payload(engine, payload, 1, base))
    expected = dict(export_weights(policy))
    state = engine.model.state_dict()
    assert set(expected) <= set(state)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)
    # a second adapter is merged into the original base weights, not on top of the first merge
    for t in adapter.values():
        t.mul_(0)
    asyncio.run(apply_payload(engine, WeightPayload("adapter", adapter, scaling), 2, base))
    for name in expected:
        torch.testing.assert_close(engine.model.state_dict()[name], base[name])


def test_bucket_layout_packs_every_tensor_once_within_the_budget():
    metas = [TensorMeta(f"t{i}", shape, dtype) for i, (shape, dtype) in enumerate(
        [((3, 5), torch.bfloat16), ((7,), torch.float32), ((1000,), torch.float32), ((2, 2), torch.int64),
         ((5,), torch.float16)])]
    buckets = bucket_layout(metas, bucket_bytes=1024)
    seen = [i for b in buckets for i, _ in b]
    assert seen == list(range(len(metas)))
    for bucket in buckets:
        offsets = [off for _, off in bucket]
        assert all(off % 256 == 0 for off in offsets) and offsets == sorted(offsets)
        end = bucket[-1][1] + metas[bucket[-1][0]].nbytes
        assert end <= 1024 or len(bucket) == 1      # only a tensor larger than the budget goes alone
