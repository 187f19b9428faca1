"""The trainer on real vLLM (CPU build): LoRA training steps whose weight sync sends only the adapter."""

import asyncio
import os

import pytest

pytestmark = pytest.mark.vllm
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
pytest.importorskip("vllm")

from turnrl.config import load_config  # noqa: E402
from turnrl.train.trainer import Trainer  # noqa: E402


@pytest.mark.parametrize("lora_slots", [8, 0])
def test_lora_training_on_vllm_syncs_the_adapter_or_the_merged_weights(tmp_path, lora_slots):
    cfg = load_config(None, [
        "model.name=smollm2-135m-instruct", "model.lora.rank=4", "engine.kind=vllm",
        f"engine.max_lora_rank={lora_slots}", "engine.max_model_len=1024", "engine.cpu_kv_cache_gb=1.0",
        "data.train.task=calculator", "data.train.size=4", "data.train.options={demo: true}",
        "data.prompts_per_step=2", "rollout.n=2", "rollout.max_response_tokens=96",
        "rollout.sampling.max_tokens_per_turn=32", "reward.functions=[exact_answer, tool_success]",
        "trainer.steps=2", "trainer.optim.lr=1e-3", "logging.sinks=[]", "logging.progress=off",
        f"output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    engine = trainer.engine
    history = asyncio.run(trainer.run())
    assert len(history) == 2
    assert history[-1]["mismatch/mean_abs"] < 0.2          # vLLM bf16 vs trainer logprobs on the same tokens
    if lora_slots:
        assert engine.stats["lora_updates"] == 2 and engine.stats["weight_updates"] == 0
    else:
        assert engine.stats["weight_updates"] == 2
