import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from turnrl import models
from turnrl.models import ALIASES, STAMP, Alias, ModelError, is_prepared, model_dir, prepare, resolve

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


# ------------------------------------------------------------------------------------------- SmolLM2


def test_smollm2_resolves_to_a_prepared_hf_directory(smollm2_dir):
    assert smollm2_dir == model_dir("smollm2-135m-instruct")
    assert is_prepared("smollm2-135m-instruct")
    assert json.loads((smollm2_dir / STAMP).read_text()) == {"version": 1, "alias": "smollm2-135m-instruct"}
    for name in ("config.json", "tokenizer_config.json", "model.safetensors"):
        assert (smollm2_dir / name).is_file()
    assert resolve("smollm2-135m-instruct") == smollm2_dir   # reused, not rebuilt
    assert resolve(str(smollm2_dir)) == smollm2_dir           # the directory is a valid spec too


def test_smollm2_tokenizer_and_chatml_template(smol_tokenizer):
    tok = smol_tokenizer
    assert tok.convert_tokens_to_ids(IM_END) == 2 and tok.eos_token_id == 2
    assert tok.convert_tokens_to_ids(IM_START) == 1
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n")
    prompt = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # default system
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    # Special tokens are single ids in the rendered text.
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(1) == 3 and ids.count(2) == 3


def test_smollm2_greedy_answer_ends_at_im_end_and_mentions_paris(smollm2_dir, smol_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert model.config.vocab_size == len(smol_tokenizer) == 49152
    prompt = smol_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=32, do_sample=False, pad_token_id=2)
    new = out[0, prompt["input_ids"].shape[1]:].tolist()
    assert new[-1] == 2, "greedy decoding must stop at <|im_end|> within 32 tokens"
    answer = smol_tokenizer.decode(new[:-1])
    assert "Paris" in answer
    assert answer[0].isupper() and answer.rstrip().endswith(".") and len(answer.split()) >= 3


# ------------------------------------------------------------------------------------------- tiny-random


def test_tiny_random_builds_loads_and_shares_smollm2_vocab(smol_tokenizer):
    path = prepare("tiny-random")
    assert path == model_dir("tiny-random") and is_prepared("tiny-random")
    assert resolve("tiny-random") == path
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.get_vocab() == smol_tokenizer.get_vocab()
    assert tok.chat_template == smol_tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == len(smol_tokenizer)
    ids = torch.tensor([[1, 504, 3575, 2]])
    logits = model(ids).logits
    assert logits.shape == (1, 4, len(smol_tokenizer)) and torch.isfinite(logits).all()


# ------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("spec", ["/no/such/turnrl-model", "./missing-model", "~/missing-turnrl-model", "a/b/c"])
def test_missing_local_directory(spec):
    with pytest.raises(ModelError, match=r"Model directory '.*' does not exist\. Pass an existing"):
        resolve(spec)


def test_directory_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelError, match="holds no config.json: not a Hugging Face model"):
        resolve(str(tmp_path))


def test_unknown_name_lists_built_ins_and_suggests():
    with pytest.raises(ModelError) as info:
        resolve("smollm2")
    msg = str(info.value)
    assert "Unknown model 'smollm2'" in msg and "smollm2-135m-instruct, tiny-random" in msg
    assert "Did you mean 'smollm2-135m-instruct'?" in msg
    with pytest.raises(ModelError, match="The model spec is empty"):
        resolve("")


def test_uncached_hub_id_says_how_to_download(tmp_path, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelError) as info:
        resolve("nobody-turnrl/not-a-model")
    msg = str(info.value)
    assert "not in the local Hugging Face cache" in msg
    assert "huggingface-cli download nobody-turnrl/not-a-model" in msg


def _fake_hub_cache(root, repo, files):
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("c" * 40)
    snapshot = folder / "snapshots" / ("c" * 40)
    snapshot.mkdir(parents=True)
    for name in files:
        (snapshot / name).write_text("{}")
    return snapshot


def test_cached_hub_id_resolves_to_its_snapshot(tmp_path, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = _fake_hub_cache(tmp_path, "acme/small", ["config.json"])
    assert resolve("acme/small") == snapshot
    _fake_hub_cache(tmp_path, "acme/partial", ["README.md"])
    with pytest.raises(ModelError, match="holds no config.json"):
        resolve("acme/partial")


def test_prepare_unknown_built_in():
    with pytest.raises(ModelError, match="Unknown built-in model 'gpt2'. Built-ins: smollm2-135m-instruct"):
        prepare("gpt2")


# ------------------------------------------------------------------------------------------- prepare


def _write_model(out):
    (out / "config.json").write_text("{}")
    (out / "tokenizer_config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"")


def test_prepare_builds_once_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNRL_HOME", str(tmp_path))
    builds = []
    monkeypatch.setitem(ALIASES, "fake", Alias("fake", "test", lambda out: (builds.append(out), _write_model(out))))
    assert models.turnrl_home() == tmp_path
    path = prepare("fake")
    assert path == tmp_path / "models" / "fake" and is_prepared("fake")
    assert prepare("fake") == path and len(builds) == 1   # the stamp makes the second call a no-op
    assert builds[0] != path                              # built elsewhere, then renamed into place
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["fake"]
    (path / STAMP).write_text(json.dumps({"version": 0}))  # an old stamp: rebuilt
    assert prepare("fake") == path and len(builds) == 2 and is_prepared("fake")


@pytest.mark.parametrize("build, message", [
    (lambda out: (out / "config.json").write_text("{}"), "lacks tokenizer_config.json"),
    (lambda out: 1 / 0, None),
])
def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch, build, message):
    monkeypatch.setenv("TURNRL_HOME", str(tmp_path))
    monkeypatch.setitem(ALIASES, "broken", Alias("broken", "test", build))
    with pytest.raises(ModelError if message else ZeroDivisionError, match=message):
        prepare("broken")
    assert not is_prepared("broken")
    assert list((tmp_path / "models").iterdir()) == []   # no half-written model, no temporary directory


def test_is_prepared_rejects_unreadable_stamp(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNRL_HOME", str(tmp_path))
    folder = tmp_path / "models" / "x"
    folder.mkdir(parents=True)
    assert not is_prepared("x")
    (folder / STAMP).write_text("{not json")
    assert not is_prepared("x")
    (folder / STAMP).write_text(json.dumps({"version": 1}))
    assert is_prepared("x")
