"""`turnrl sft` on the tiny model: metrics, checkpoints, exact resume, the exported model, token-budget
micro-batches, and rejection sampling (rollout --min-reward -> accepted.jsonl -> SFT, and sft.rounds)."""

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch

import turnrl.train.sft as sft_module
import turnrl.train.sft_run as sft_run
from turnrl.cli import main
from turnrl.config import load_config
from turnrl.train.batching import to_rows
from turnrl.models import prepare
from turnrl.observe.store import read_trajectories
from turnrl.rollout.factory import load_template
from turnrl.train.policy import load_policy
from turnrl.train.sft import load_examples, sft_epoch
from turnrl.train.sft_run import SFTRun

HERE = Path(__file__).parent
LENGTH_PARITY = f"[{HERE / 'rewards_for_tests.py'}:length_parity]"   # varies on any output: 0, .25, ... 1
VOLATILE = ("time/", "throughput/")


def sft_config(out: Path, *extra: str):
    """Built-in calculator demonstrations, 4 conversations, 2 per step, 2 epochs: 4 optimizer steps."""
    return load_config(None, [
        "model.name=tiny-random", "trainer.dtype=float32", "engine.dtype=float32",
        "data.train.task=calculator", "data.train.size=4", "sft.batch_size=2", "sft.epochs=2",
        "trainer.optim.lr=1e-3", "logging.sinks=[]", "logging.progress=off", f"output_dir={out}", *extra])


def run(cfg) -> list[dict]:
    return asyncio.run(SFTRun(cfg).run())


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.fixture(scope="module", autouse=True)
def one_thread(torch_threads):
    """Training and the engine on one thread: on a shared 2-core machine a second one mostly waits."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, one_thread):
    """A full fine-tuning run that keeps a checkpoint after every step."""
    out = tmp_path_factory.mktemp("sft_full")
    cfg = sft_config(out, "trainer.save_every=1", "trainer.keep_checkpoints=0")
    return out, cfg, run(cfg)


def test_sft_run_logs_metrics_checkpoints_and_exports_a_loadable_model(full_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, cfg, history = full_run
    lines = metrics(out)
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    losses = [r["sft/loss"] for r in lines]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert all(r["grad_norm"] > 0 and r["lr"] == pytest.approx(1e-3) for r in lines)
    # Each epoch's steps train every assistant token of the data set once.
    template = load_template(prepare("tiny-random"))
    examples, skipped = load_examples(cfg, template)
    assert skipped == 0 and len(examples) == 4
    per_epoch = sum(sum(t.segment.loss_mask) for t in examples)
    assert sum(r["sft/tokens"] for r in lines[:2]) == sum(r["sft/tokens"] for r in lines[2:]) == per_epoch

    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_000004"
    assert sorted(p.name for p in ckpts.glob("step_*")) == [f"step_00000{i}" for i in range(1, 5)]
    assert json.loads((ckpts / "step_000004" / "trainer_state.json").read_text())["step"] == 4

    exported = out / "model"
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.dtype == torch.bfloat16 and not (exported / "adapter_config.json").exists()
    assert AutoTokenizer.from_pretrained(exported).chat_template is not None
    trained = weights(ckpts / "step_000004" / "model")
    assert all(torch.equal(v, trained[k].to(torch.bfloat16)) for k, v in weights(exported).items())
    base = weights(prepare("tiny-random"))
    assert not torch.equal(trained["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])
    batch = to_rows(examples[:1], pad_id=template.tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert torch.isfinite(logits.float()).all()


def test_resume_from_a_checkpoint_continues_the_same_run(full_run, tmp_path):
    """Resumed mid-epoch (step 1 of 2): the same batches, losses and final weights as the uninterrupted run."""
    out, _, _ = full_run
    history = run(sft_config(tmp_path, f"trainer.resume={out / 'checkpoints' / 'step_000001'}"))
    assert [r["step"] for r in metrics(tmp_path)] == [2, 3, 4]
    assert len(history) == 3 and stable(metrics(tmp_path)) == stable(metrics(out)[1:])
    resumed, uninterrupted = weights(tmp_path / "model"), weights(out / "model")
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(v, uninterrupted[k]) for k, v in resumed.items())


def test_lora_run_resumes_and_exports_a_merged_model(tmp_path):
    first = run(sft_config(tmp_path / "a", "model.lora.rank=4", "trainer.save_every=2"))
    ckpt = tmp_path / "a" / "checkpoints" / "step_000002"
    assert (ckpt / "model" / "adapter_model.safetensors").is_file()  # the checkpoint is the adapter alone
    losses = [r["sft/loss"] for r in first]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    resumed = run(sft_config(tmp_path / "b", "model.lora.rank=4", f"trainer.resume={ckpt}"))
    assert stable(resumed) == stable(first[2:])

    exported, base = weights(tmp_path / "a" / "model"), weights(prepare("tiny-random"))
    assert not (tmp_path / "a" / "model" / "adapter_config.json").exists()
    assert exported.keys() == base.keys()  # merged into plain weight names, no lora_A/lora_B
    embed = "model.embed_tokens.weight"
    assert torch.equal(exported[embed], base[embed].to(torch.bfloat16))  # not a LoRA target
    proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(exported[proj], base[proj].to(torch.bfloat16))  # the adapter was merged in


def test_bf16_weights_with_fp32_masters_train_lora_and_resume_exactly(tmp_path):
    """trainer.param_dtype=bfloat16 in SFT: the adapters train from fp32 masters (clipped there), the base
    weights are bf16, and a resumed run takes the same steps."""
    bf16 = ["model.lora.rank=4", "trainer.dtype=bfloat16", "trainer.param_dtype=bfloat16"]
    first = run(sft_config(tmp_path / "a", *bf16, "trainer.save_every=2"))
    assert len(first) == 4 and all(r["grad_norm"] > 0 and math.isfinite(r["sft/loss"]) for r in first)
    ckpt = tmp_path / "a" / "checkpoints" / "step_000002"
    resumed = run(sft_config(tmp_path / "b", *bf16, f"trainer.resume={ckpt}"))
    assert stable(resumed) == stable(first[2:])


def test_token_budget_micro_batches_take_the_same_step_as_one_batch(monkeypatch):
    """A budget that fits one row per micro-batch (each cut to its own length) gives the step that a single
    padded micro-batch gives: the loss is the token mean over the whole mini-batch either way."""
    cfg = sft_config(Path("unused"))
    model_dir = prepare("tiny-random")
    template = load_template(model_dir)
    examples, _ = load_examples(cfg, template)
    assert len({len(t.segment) for t in examples}) > 1  # rows of different lengths: padding matters
    splits = []
    real = sft_module.micro_batches
    monkeypatch.setattr(sft_module, "micro_batches", lambda *a: splits.append(real(*a)) or splits[-1])

    def one_step(budget: int) -> tuple[float, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = load_policy(str(model_dir), torch.device("cpu"))
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        logged = []
        sft_epoch(model, optimizer, scheduler, examples, len(examples), budget, 0.0, None, torch.device("cpu"),
                  order_seed=0, pad_id=template.tokenizer.pad_token_id, on_step=lambda b, m: logged.append(m))
        after = [p.detach().clone() for p in model.parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(before, after))
        return logged[0]["sft/loss"], after

    whole_loss, whole = one_step(1 << 20)
    split_loss, split = one_step(1)
    assert [len(s) for s in splits] == [1, len(examples)]
    widths = [w for _, w in splits[1]]
    assert widths == sorted(widths, reverse=True) and widths[-1] < widths[0]
    assert split_loss == pytest.approx(whole_loss, rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(whole, split))


ROLLOUT = f"""\
# turnrl rollout THIS --out DIR --min-reward 0.75
model: {{name: tiny-random}}
engine: {{dtype: float32}}
data:
  train: {{task: calculator, size: 3, seed: 7}}
rollout:
  n: 2
  max_response_tokens: 40
  sampling: {{max_tokens_per_turn: 12}}
reward:
  functions: {LENGTH_PARITY}
logging: {{progress: "off", sinks: []}}
"""


def test_rollout_min_reward_feeds_sft_the_accepted_ledgers_token_for_token(tmp_path, monkeypatch):
    config = tmp_path / "rollout.yaml"
    config.write_text(ROLLOUT)
    out = tmp_path / "rollout"
    assert main(["rollout", str(config), "--out", str(out), "--min-reward", "0.75"]) == 0
    sampled = [t for t, _ in read_trajectories(out / "trajectories.jsonl")]
    accepted = [t for t, _ in read_trajectories(out / "accepted.jsonl")]
    expected = [t for t in sampled if t.reward >= 0.75 and not t.masked]
    assert len(sampled) == 6 and 0 < len(accepted) < len(sampled)  # the threshold really filters
    assert [(t.group_id, t.sample_index) for t in accepted] == [(t.group_id, t.sample_index) for t in expected]
    assert all(t.reward >= 0.75 for t in accepted)
    assert json.loads((out / "summary.json").read_text())["accepted"] == len(accepted)

    seen = []
    monkeypatch.setattr(sft_run, "sft_epoch", lambda model, opt, sched, examples, *a: seen.append(examples)
                        or sft_epoch(model, opt, sched, examples, *a))
    sft_yaml = tmp_path / "sft.yaml"
    sft_yaml.write_text(f"data: {{train: {{path: {out / 'accepted.jsonl'}}}}}\n")
    sft_out = tmp_path / "sft"
    assert main(["sft", str(sft_yaml), "model.name=tiny-random", "trainer.dtype=float32", "sft.batch_size=2",
                 "logging.sinks=[]", "logging.progress=off", f"output_dir={sft_out}"]) == 0
    [trained] = seen
    key = lambda t: (t.group_id, t.sample_index)  # noqa: E731
    assert sorted(map(key, trained)) == sorted(map(key, expected))
    by_key = {key(t): t for t in expected}
    for t in trained:  # the sampled tokens themselves, not a re-tokenized render of the decoded text
        ledger = by_key[key(t)]
        assert [s.token_ids for s in t.segments] == [s.token_ids for s in ledger.segments]
        assert [s.loss_mask for s in t.segments] == [s.loss_mask for s in ledger.segments]
        assert [s.sources for s in t.segments] == [s.sources for s in ledger.segments]
    # The random model samples non-canonical tokenizations: re-rendering those conversations would train other ids.
    template = load_template(prepare("tiny-random"))
    drift = [t for t in trained if t.parity == "token_drift"]
    assert drift and all(template.encode(template.render(t.messages)) != t.segment.token_ids for t in drift)
    assert len(metrics(sft_out)) == math.ceil(len(expected) / 2)
    assert (sft_out / "model" / "config.json").is_file()


def test_rejection_sampling_round_trains_on_the_accepted_samples(tmp_path, monkeypatch):
    sampled_batches, trained = [], []
    real_run_batch = sft_run.run_batch

    async def spy_run_batch(*a, **k):
        sampled_batches.append(await real_run_batch(*a, **k))
        return sampled_batches[-1]
    monkeypatch.setattr(sft_run, "run_batch", spy_run_batch)
    monkeypatch.setattr(sft_run, "sft_epoch", lambda model, opt, sched, examples, *a: trained.append(examples)
                        or sft_epoch(model, opt, sched, examples, *a))
    cfg = sft_config(tmp_path, "sft.rounds=1", "sft.prompts_per_round=3", "sft.min_reward=0.5", "sft.epochs=1",
                     "rollout.n=2", "rollout.max_response_tokens=40", "rollout.sampling.max_tokens_per_turn=12",
                     f"reward.functions={LENGTH_PARITY}")
    run(cfg)
    [sampled] = sampled_batches
    accepted = [t for t in sampled if t.reward >= 0.5 and not t.masked]
    assert len(sampled) == 6 and 0 < len(accepted) < 6
    assert trained == [accepted]  # the very trajectory objects (their exact ledgers), nothing re-rendered
    lines = metrics(tmp_path)
    [round_line] = [r for r in lines if "rft/accepted" in r]
    assert round_line["rft/round"] == 0 and round_line["rft/sampled"] == 6
    assert round_line["rft/accepted"] == len(accepted)
    assert round_line["reward/mean"] == pytest.approx(sum(t.reward for t in sampled) / 6)
    sft_lines = [r for r in lines if "sft/loss" in r]
    assert len(sft_lines) == math.ceil(len(accepted) / 2) and all(math.isfinite(r["sft/loss"]) for r in sft_lines)
    assert (tmp_path / "model" / "config.json").is_file()


def test_rejection_sampling_refuses_resume(tmp_path, capsys):
    """Rounds keep no resumable state: a resume request is an error, not a silent restart from the base model."""
    (tmp_path / "empty.yaml").write_text("{}\n")
    out = tmp_path / "run"
    assert main(["sft", str(tmp_path / "empty.yaml"), "model.name=tiny-random", "sft.rounds=1",
                 "trainer.resume=latest", f"output_dir={out}"]) == 2
    assert "trainer.resume is not supported with rejection sampling" in capsys.readouterr().err
    assert not out.exists()
