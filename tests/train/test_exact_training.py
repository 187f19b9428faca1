"""engine.exact in the RL loop: the engine's logprobs equal the trainer's bit for bit every step (with and
without LoRA), the PPO ratio is exactly 1 on the first mini-batch, and a resumed run samples the same tokens."""

import asyncio
import json

import pytest
import torch

from turnrl.config import load_config
from turnrl.train.trainer import Trainer
from turnrl.train.metrics import batch_rows
from turnrl.train.update import logprob_pass

from test_trainer import stable, tiny_config

EXACT = ("engine.exact=true", "engine.device=cpu", "trainer.device=cpu")


def run(cfg):
    return asyncio.run(Trainer(cfg).run())


@pytest.mark.parametrize("extra", [[], ["model.lora.rank=4", "model.lora.dropout=0", "algo.kl_coef=0.05"],
                                   ["engine.dtype=bfloat16"]])
def test_engine_and_trainer_logprobs_are_equal_every_step(tmp_path, torch_threads, extra):
    with torch_threads(1):
        # 4 samples per prompt: with 2, both groups of a bf16 step once scored alike (no advantage, no gradient)
        history = run(tiny_config(tmp_path, "trainer.steps=2", "rollout.n=4", *EXACT, *extra))
    for metrics in history:
        assert metrics["mismatch/max_abs"] == 0.0 and metrics["mismatch/mean_abs"] == 0.0
        assert metrics["grad_norm"] > 0          # and it trains: the weights the engine samples with move
    assert history[0]["response_tokens/mean"] > 0


def test_ppo_ratio_is_exactly_one_on_the_first_mini_batch(tmp_path, torch_threads):
    with torch_threads(1):
        cfg = tiny_config(tmp_path, "trainer.steps=1", "trainer.mini_batches=2", "model.lora.rank=4",
                          "model.lora.dropout=0", *EXACT)
        trainer = Trainer(cfg)
        try:
            tasks = trainer.data.take(cfg.data.prompts_per_step)
            trajs, _ = asyncio.run(trainer.rollout(tasks, cfg.rollout.n, 0))
            asyncio.run(__import__("turnrl.rewards.functions", fromlist=["score_all"]).score_all(
                trajs, trainer.rewards, True, True))
            x = trainer.step_inputs
            rows, _, _, _ = batch_rows(trajs, x.settings.turn_level, x.pad_id, x.device)
            rows.old_logprobs = logprob_pass(trainer.policy, rows, trainer.settings, trainer.amp)  # run_step's pass
            mask = rows.loss_mask > 0
            assert torch.equal(rows.old_logprobs[mask], rows.engine_logprobs[mask])   # the no-grad pass
            trainer.policy.train()
            with torch.enable_grad():                                               # the update's forward
                from turnrl.train.policy import forward_logprobs
                lp, _ = forward_logprobs(trainer.policy, rows.input_ids, rows.attention_mask, rows.position_ids,
                                         trainer.settings.temperature, select=mask, exact=trainer.settings.exact)
            assert lp.requires_grad
            ratio = torch.exp(lp.detach() - rows.old_logprobs)[mask]
            assert bool((ratio == 1.0).all())
            again = logprob_pass(trainer.policy, rows, trainer.settings, trainer.amp)
            assert torch.equal(again[mask], rows.old_logprobs[mask])
        finally:
            asyncio.run(trainer.engine.close())


def test_resume_samples_the_same_tokens(tmp_path, torch_threads):
    out = tmp_path / "run"
    with torch_threads(1):
        full = run(tiny_config(out, "trainer.steps=2", "trainer.save_every=1", "trainer.trajectories_per_step_saved=4",
                               *EXACT))
        tokens = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
        # drop the last step and continue from the step-1 checkpoint: step 2 is sampled again
        (out / "checkpoints" / "latest").write_text("step_000001")
        resumed = run(tiny_config(out, "trainer.steps=2", "trainer.save_every=1", "trainer.resume=latest",
                                  "trainer.trajectories_per_step_saved=4", *EXACT))
    again = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(resumed) == 1 and stable(resumed[0]) == stable(full[1])
    assert resumed[0]["mismatch/max_abs"] == 0.0

    def step2(rows):
        return [json.dumps({k: r[k] for k in r if k == "segments"}, sort_keys=True)
                for r in rows if r.get("step") == 2]
    assert step2(again) == step2(tokens) and step2(tokens)


def test_exact_refuses_what_it_cannot_keep_exact(tmp_path):
    with pytest.raises(ValueError, match="top_p=1"):
        Trainer(tiny_config(tmp_path, "rollout.sampling.top_p=0.9", *EXACT))
    with pytest.raises(Exception, match="kind: hf"):
        load_config(None, ["engine.kind=vllm", "engine.exact=true"])


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("extra", [[], ["model.lora.rank=4", "model.lora.dropout=0"]])
def test_gpu_bf16_training_steps_have_zero_mismatch(tmp_path, extra):
    history = run(tiny_config(tmp_path, "trainer.steps=2", "engine.exact=true", "engine.device=cuda",
                              "trainer.device=cuda", "engine.dtype=bfloat16", "rollout.n=8", *extra))
    for metrics in history:
        assert metrics["mismatch/max_abs"] == 0.0 and metrics["grad_norm"] > 0
