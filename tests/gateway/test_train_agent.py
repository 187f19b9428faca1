"""`turnrl train` with `agent: {entrypoint: ...}`: the openai-SDK example agent through the gateway feeds GRPO.

The tiny random model keeps it fast (its text is garbage: no tool calls, reward 0); the examples run on SmolLM2
in test_examples.py."""

import json

from turnrl.cli import main
from turnrl.observe.store import read_trajectories


def test_train_step_through_the_gateway(tmp_path, torch_threads):
    out = tmp_path / "run"
    with torch_threads(1):
        code = main(["train", "examples/agents/openai_sdk/train.yaml", "engine.kind=hf", "trainer.steps=1",
                     "model.name=tiny-random", "agent.timeout_s=600",
                     "data.prompts_per_step=2", "rollout.n=2", "rollout.sampling.max_tokens_per_turn=24",
                     "model.lora.rank=4", "model.lora.alpha=8", "logging.progress=off", f"output_dir={out}"])
    assert code == 0
    [metrics] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics["trajectories"] == 4 and metrics["gateway/calls"] >= 1
    assert "reward/exact_answer" in metrics and "mismatch/mean_abs" in metrics and metrics["masked"] == 0
    trajs = [t for t, _ in read_trajectories(out / "trajectories.jsonl")]
    assert len(trajs) == 4 and all(t.info.get("session") for t in trajs)
    assert all(t.parity in ("exact", "token_drift", "split") for t in trajs)
    assert (out / "checkpoints" / "latest").is_file()
