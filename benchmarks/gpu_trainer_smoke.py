"""The RL trainer on a GPU with its CUDA defaults: a few real steps, and what it chose.

    python benchmarks/gpu_trainer_smoke.py OUT_DIR [overrides...]     (e.g. model.lora.rank=0 trainer.compile=true)

The main job's calculator task on `tiny-random` (the one model that travels to the GPU machine), the hf engine,
packed micro-batches, 3 steps with a checkpoint at step 2, and a reward that varies on a random model's output
(`tests/train/rewards_for_tests.py`). Prints the attention implementation (`trainer.packed_attention: auto`),
whether fp32 master weights were made (`trainer.param_dtype: auto`), the parameters' dtypes and each step's loss
and gradient norm; fails on a non-finite loss."""
import asyncio
import math
import sys

from turnrl.config import load_config
from turnrl.train.trainer import Trainer

if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python benchmarks/gpu_trainer_smoke.py OUT_DIR [overrides...]")
    extra = sys.argv[2:]
    cfg = load_config("examples/calculator/train.yaml", [
        "model.name=tiny-random", "engine.kind=hf", "trainer.steps=3", "trainer.packing=true",
        f"output_dir={sys.argv[1]}", "data.prompts_per_step=4", "rollout.n=4", "trainer.save_every=2",
        "reward.functions=[tests.train.rewards_for_tests:length_parity]", "reward.weights=[1.0]",
        "reward.accuracy_part=null", *extra])
    t = Trainer(cfg)
    base = t.policy.get_base_model() if hasattr(t.policy, "peft_config") else t.policy
    dtypes = sorted({str(p.dtype) for p in t.policy.parameters()})
    print("SMOKE", extra, "attention", base.config._attn_implementation, "masters", t.master is not None,
          "param dtypes", dtypes, flush=True)
    history = asyncio.run(t.run())
    losses = [h.get("loss/policy") for h in history]
    print("SMOKE losses", losses, "grad_norm", [h.get("grad_norm") for h in history], flush=True)
    assert all(x is not None and math.isfinite(x) for x in losses)
