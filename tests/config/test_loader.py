import dataclasses
import json
import typing

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.cli import main
from turnrl.config import Config, ConfigError, config_from_dict, dump_yaml, load_config, to_dict
from turnrl.config.loader import apply_overrides, parse_override, read_yaml
from turnrl.config.schema import DatasetConfig

SECRET = "wk-9f3c1d7e5b2a4c6e8d0f"


def error_of(data=None, overrides=()):
    with pytest.raises(ConfigError) as info:
        config_from_dict(data or {}, list(overrides))
    return str(info.value)


# ------------------------------------------------------------------------------------------- defaults


def test_defaults_build_and_match_the_dataclasses():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.model.name == "smollm2-135m-instruct"
    assert cfg.data.train == DatasetConfig(task="calculator")
    assert cfg.data.eval is None
    assert cfg.trainer.optim.betas == [0.9, 0.999]


def test_yaml_file_and_overrides_combine(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  name: tiny-random\n  lora: {rank: 8}\nrollout:\n  n: 2\n  sampling:\n    top_p: 0.9\n")
    cfg = load_config(path, ["rollout.n=16", "model.lora.alpha=8", "rollout.sampling.temperature=0.7"])
    assert cfg.model.name == "tiny-random"
    assert cfg.model.lora.rank == 8 and cfg.model.lora.alpha == 8.0 and isinstance(cfg.model.lora.alpha, float)
    assert cfg.rollout.n == 16                      # the override wins over the file
    assert cfg.rollout.sampling.top_p == 0.9        # untouched file values stay
    assert cfg.rollout.sampling.temperature == 0.7
    assert cfg.rollout.sampling.max_tokens_per_turn == 256  # unset keys keep their defaults


# ------------------------------------------------------------------------------------------- unknown keys


def test_unknown_top_level_key_names_it_and_suggests():
    msg = error_of({"rollot": {"n": 2}})
    assert "Unknown config key 'rollot'" in msg
    assert "Did you mean 'rollout'?" in msg
    assert "Valid keys:" in msg and "trainer" in msg


@pytest.mark.parametrize("override, full, suggestion", [
    ("rollout.sampling.topp=0.5", "rollout.sampling.topp", "rollout.sampling.top_p"),
    ("model.lora.rnak=4", "model.lora.rnak", "model.lora.rank"),
    ("trainer.optim.qqq=1", "trainer.optim.qqq", None),
    ("algo.clip_hi=0.3", "algo.clip_hi", "algo.clip_high"),
])
def test_unknown_nested_key_names_full_dotted_key(override, full, suggestion):
    msg = error_of(overrides=[override])
    assert f"Unknown config key '{full}'." in msg
    if suggestion:
        assert f"Did you mean '{suggestion}'?" in msg
    else:
        assert "Did you mean" not in msg


def test_unknown_key_inside_optional_section_is_reported_not_swallowed():
    # data.eval is `DatasetConfig | None`: the error must come from inside the section.
    msg = error_of(overrides=["data.eval.task=calculator", "data.eval.pth=x.jsonl"])
    assert "Unknown config key 'data.eval.pth'" in msg and "Did you mean 'data.eval.path'?" in msg


def test_unknown_key_inside_list_item():
    msg = error_of({"rollout": {"tools": [{"class_name": "calculator", "schema": {}}]}})
    assert "Unknown config key 'rollout.tools[0].schema'" in msg
    assert "Did you mean 'rollout.tools[0].tool_schema'?" in msg


def test_missing_required_key_in_list_item():
    msg = error_of({"rollout": {"tools": [{"config": {}}]}})
    assert "Missing required config key(s) under 'rollout.tools[0]': class_name" in msg


# ------------------------------------------------------------------------------------------- wrong types


@pytest.mark.parametrize("override, expected", [
    ("rollout.n=eight", "'rollout.n' must be an integer, got 'eight'"),
    ("rollout.n=2.5", "'rollout.n' must be an integer, got 2.5"),
    ("rollout.n=true", "'rollout.n' must be an integer, got True"),
    ("data.shuffle=1", "'data.shuffle' must be true or false, got 1"),
    ("data.shuffle=yes please", "'data.shuffle' must be true or false, got 'yes please'"),
    ("model.name=12", "'model.name' must be a string, got 12 (quote it in YAML)"),
    ("algo.gamma=high", "'algo.gamma' must be a number, got 'high'"),
    ("algo.gamma=false", "'algo.gamma' must be a number, got False"),
    ("model.lora=4", "'model.lora' must be a mapping (LoraConfig), got 4"),
    ("reward.functions=accuracy", "'reward.functions' must be a list of str, got 'accuracy'"),
    ("reward.weights=[1, two]", "'reward.weights[1]' must be a number, got 'two'"),
    ("model.lora.target_modules=[1]", "'model.lora.target_modules[0]' must be a string, got 1"),
    ("data.eval=5", "'data.eval' must be a mapping (DatasetConfig) or null, got 5"),
    ("data.train.options=[1]", "'data.train.options' must be a mapping of any value, got [1]"),
])
def test_wrong_type_names_key_and_expected_type(override, expected):
    assert expected in error_of(overrides=[override])


def test_ints_widen_to_float_and_exponent_strings_are_numbers():
    cfg = config_from_dict({"trainer": {"optim": {"lr": "3e-6"}}}, ["algo.gamma=1", "algo.lam=.5"])
    assert cfg.algo.gamma == 1.0 and isinstance(cfg.algo.gamma, float)
    assert cfg.algo.lam == 0.5
    # PyYAML reads `1e-5` (no dot) as a string; a float field still takes it.
    assert cfg.trainer.optim.lr == 3e-6
    assert config_from_dict({}, ["trainer.optim.lr=1e-5"]).trainer.optim.lr == 1e-5
    assert "'rollout.n' must be an integer, got '1e3'" in error_of(overrides=["rollout.n=1e3"])


def test_huge_integer_is_a_config_error():
    assert "too large for a number" in error_of(overrides=["trainer.optim.lr=1" + "0" * 400])
    assert "Bad override" in error_of(overrides=["seed=1" + "0" * 5000])  # past Python's int-string limit


# ------------------------------------------------------------------------------------------- literals


@pytest.mark.parametrize("override, key, suggestion", [
    ("algo.advantage=gpro", "algo.advantage", "'grpo'"),
    ("rollout.on_mismatch=splt", "rollout.on_mismatch", "'split'"),
    ("engine.dtype=bf16", "engine.dtype", "'bfloat16'"),
    ("logging.sinks=[console, wandbb]", "logging.sinks[1]", "'wandb'"),
])
def test_literal_mismatch_lists_choices_and_suggests(override, key, suggestion):
    msg = error_of(overrides=[override])
    assert f"'{key}' must be one of" in msg
    assert f"Did you mean {suggestion}?" in msg


def test_literal_without_close_match_has_no_suggestion():
    msg = error_of(overrides=["engine.kind=tensorrt"])
    assert "'engine.kind' must be one of 'hf', 'vllm', 'vllm_server', got 'tensorrt'." in msg
    assert "Did you mean" not in msg


# ------------------------------------------------------------------------------------------- override syntax


@pytest.mark.parametrize("text, fragment", [
    ("rollout.n", "expected KEY=VALUE"),
    ("=3", "the key '' must be dotted names"),
    ("rollout..n=3", "the key 'rollout..n' must be dotted names"),
    ("rollout.n.=3", "must be dotted names"),
    ("roll out.n=3", "must be dotted names"),
    ("model.name=[unclosed", "the value does not parse"),
    ("model.name=a: b: c", "Quote strings that contain ':'"),
])
def test_bad_override_syntax(text, fragment):
    with pytest.raises(ConfigError, match="Bad override") as info:
        parse_override(text)
    assert fragment in str(info.value)


def test_parse_override_values_are_yaml():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override(" a = 0.5 ") == (["a"], 0.5)
    assert parse_override("a=null") == (["a"], None)
    assert parse_override("a=") == (["a"], "")
    assert parse_override("a=[1, x]") == (["a"], [1, "x"])
    assert parse_override("a={k: v}") == (["a"], {"k": "v"})
    assert parse_override("a=x=y") == (["a"], "x=y")        # only the first '=' splits
    assert parse_override("a-b.c_d=on") == (["a-b", "c_d"], True)


def test_overrides_into_nested_sections_and_lists():
    data = {"rollout": {"tools": [{"class_name": "calculator"}, {"class_name": "checker", "config": {"x": 1}}]}}
    cfg = config_from_dict(data, [
        "rollout.tools.1.config.x=2", "rollout.tools.1.config.y=[a, b]", "rollout.tools.0.class_name=my.mod:Tool",
        "reward.functions=[accuracy, format]", "reward.weights=[1, 0.5]", "trainer.optim.betas=[0.8, 0.9]",
        "data.eval={task: calculator, size: 4}", "data.train.options.digits=3"])
    assert [t.class_name for t in cfg.rollout.tools] == ["my.mod:Tool", "checker"]
    assert cfg.rollout.tools[1].config == {"x": 2, "y": ["a", "b"]}
    assert cfg.reward.functions == ["accuracy", "format"] and cfg.reward.weights == [1.0, 0.5]
    assert cfg.trainer.optim.betas == [0.8, 0.9]
    assert cfg.data.eval == DatasetConfig(task="calculator", size=4)
    assert cfg.data.train.options == {"digits": 3}
    assert data["rollout"]["tools"][1]["config"] == {"x": 1}  # the input mapping is not modified


def test_override_into_list_or_value_errors():
    data = {"rollout": {"tools": [{"class_name": "calculator"}]}}
    for text, fragment in [("rollout.tools.1.class_name=x", "'rollout.tools' is a list of 1 item(s); '1'"),
                           ("rollout.tools.first.class_name=x", "'first' is not an index"),
                           ("rollout.tools.0.class_name.x=1", "'rollout.tools.0.class_name' is a value")]:
        with pytest.raises(ConfigError, match="Bad override") as info:
            apply_overrides(data, [text])
        assert fragment in str(info.value)
    with pytest.raises(ConfigError, match="'model.lora' is a value, not a section"):
        apply_overrides({}, ["model.lora=3", "model.lora.rank=4"])


def test_later_override_wins_and_null_resets_optional():
    cfg = config_from_dict({"algo": {"dual_clip": 3.0}}, ["rollout.n=2", "rollout.n=5", "algo.dual_clip=null"])
    assert cfg.rollout.n == 5 and cfg.algo.dual_clip is None


# ------------------------------------------------------------------------------------------- validate()


@pytest.mark.parametrize("overrides, fragment", [
    (["rollout.sampling.top_p=0"], "rollout.sampling: 'top_p' must be in (0, 1], got 0.0."),
    (["rollout.sampling.top_p=1.5"], "'top_p' must be in (0, 1]"),
    (["algo.dual_clip=0.5"], "algo: 'dual_clip' must be > 1 (e.g. 3.0), got 0.5."),
    (["algo.tis_cap=0.5"], "'tis_cap' must be >= 1"),
    (["algo.gamma=1.5"], "'gamma' and 'lam' must be in [0, 1]"),
    (["data.train.path=x.jsonl", "data.train.task=calculator"], "data.train: set only one of 'path'"),
    (["data.eval.path=x.jsonl", "data.eval.task=calculator"], "data.eval: set only one of 'path'"),
    (["data.eval.size=3"], "data: 'eval' needs 'path' (a JSONL/Parquet file) or 'task'"),
    (["rollout.n=0"], "rollout: 'n' must be > 0, got 0."),
    (["rollout.max_user_turns=-1"], "'max_user_turns' must be >= 0"),
    (["model.lora.rank=-2"], "model.lora: 'rank' must be >= 0"),
    (["model.lora.dropout=1"], "'dropout' must be in [0, 1)"),
    (["engine.gpu_memory_utilization=0"], "'gpu_memory_utilization' must be in (0, 1]"),
    (["reward.functions=[a, b]", "reward.weights=[1]"], "'weights' has 1 entries for 2 functions"),
    (["trainer.optim.betas=[0.9]"], "'betas' must have two numbers"),
    (["trainer.steps=0"], "trainer: 'steps' must be > 0"),
])
def test_validate_errors_name_section_and_fix(overrides, fragment):
    assert fragment in error_of(overrides=overrides)


def test_validate_accepts_boundaries():
    cfg = config_from_dict({}, ["rollout.sampling.top_p=1", "algo.dual_clip=1.01", "rollout.max_user_turns=0",
                                "rollout.sampling.temperature=0"])
    assert cfg.algo.dual_clip == 1.01 and cfg.rollout.sampling.top_p == 1.0 and cfg.rollout.max_user_turns == 0


def test_train_set_defaults_to_the_built_in_task_unless_a_path_is_given():
    assert config_from_dict({}, ["data.train.size=32"]).data.train == DatasetConfig(task="calculator", size=32)
    assert config_from_dict({}, ["data.train.path=d.jsonl"]).data.train == DatasetConfig(path="d.jsonl")
    assert config_from_dict({"data": {"train": {"task": "guess"}}}).data.train.task == "guess"


# ------------------------------------------------------------------------------------------- files


def test_read_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        read_yaml(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping at the top, got list"):
        read_yaml(top)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert read_yaml(empty) == {} and load_config(empty) == Config()


# ------------------------------------------------------------------------------------------- secrets


def test_dump_yaml_redacts_secret_and_round_trips():
    cfg = config_from_dict({}, [f"logging.wandb_api_key={SECRET}", "rollout.n=3", "model.lora.rank=4"])
    text = dump_yaml(cfg)
    assert SECRET not in text
    assert yaml.safe_load(text)["logging"]["wandb_api_key"] == "***"
    assert to_dict(cfg, redact=False)["logging"]["wandb_api_key"] == SECRET
    # The unredacted dump is the whole config: loading it back gives the same config.
    assert config_from_dict(yaml.safe_load(dump_yaml(cfg, redact=False))) == cfg
    assert yaml.safe_load(dump_yaml(Config()))["logging"]["wandb_api_key"] is None  # unset: nothing to hide


def test_secret_value_never_appears_in_type_errors():
    msg = error_of(overrides=["logging.wandb_api_key=[1234567, 8901]"])
    assert "'logging.wandb_api_key' must be" in msg and "secret" in msg
    assert "1234567" not in msg


def test_cli_config_show_prints_resolved_config_without_secret(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(f"logging:\n  wandb_api_key: {SECRET}\nrollout:\n  n: 2\n")
    assert main(["config", "show", str(path), "rollout.n=8", "algo.advantage=rloo"]) == 0
    out, err = capsys.readouterr()
    shown = yaml.safe_load(out)
    assert shown["rollout"]["n"] == 8 and shown["algo"]["advantage"] == "rloo"
    assert shown["logging"]["wandb_api_key"] == "***"
    assert shown["trainer"]["optim"]["lr"] == 1e-5  # defaults are printed too: the fully resolved config
    assert SECRET not in out + err


def test_cli_config_show_reports_errors_with_exit_2(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(f"logging:\n  wandb_api_key: {SECRET}\n")
    assert main(["config", "show", str(path), "rollout.smapling.top_p=0.5"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "error: Unknown config key 'rollout.smapling'. Did you mean 'rollout.sampling'?" in err
    assert SECRET not in out + err


# ------------------------------------------------------------------------------------------- property


def _schema_keys(cls, prefix=""):
    """Every dotted key of the schema, through optional sections."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        for tp in (hints[f.name], *typing.get_args(hints[f.name])):
            if dataclasses.is_dataclass(tp):
                keys += _schema_keys(tp, key + ".")
    return keys


SCHEMA_KEYS = _schema_keys(Config)
JUNK_KEYS = st.text(alphabet="abcxyz_.-0123 ", max_size=12)
KEYS = st.one_of(st.sampled_from(SCHEMA_KEYS), JUNK_KEYS,
                 st.tuples(st.sampled_from(SCHEMA_KEYS), JUNK_KEYS).map(".".join))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=8),
                    st.sampled_from(["grpo", "hermes", "calculator", "split", "1e-5", "auto", "cuda:0"]))
VALUES = st.one_of(
    SCALARS.map(lambda v: yaml.safe_dump(v, default_flow_style=True).removesuffix("\n...\n").strip()),
    st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=3), max_leaves=6
                 ).map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip()),
    st.text(max_size=20),
)
OVERRIDES = st.one_of(st.tuples(KEYS, VALUES).map("=".join), st.text(max_size=20))


@settings(max_examples=300, deadline=None)
@given(st.lists(OVERRIDES, max_size=5))
def test_random_overrides_only_raise_config_error(overrides):
    try:
        cfg = config_from_dict({}, overrides)
    except ConfigError as exc:
        assert str(exc)
    else:
        assert isinstance(cfg, Config)
        assert isinstance(cfg.rollout.n, int) and not isinstance(cfg.rollout.n, bool)
        assert isinstance(cfg.trainer.optim.lr, float)


@pytest.mark.parametrize("override, advice", [("model.dtype=float32", "trainer.dtype"),
                                              ("trainer.log_every=5", "logged every step")])
def test_removed_keys_say_what_to_do_instead(override, advice):
    msg = error_of(overrides=[override])
    assert "was removed" in msg and advice in msg


@pytest.mark.parametrize("name", ["\x85", "a\x85b", "run\u2028two", "tab\there", "bell\x07", "line\nbreak", "é ü"])
def test_dumped_yaml_brings_back_strings_with_line_separators_and_control_characters(name):
    """PyYAML writes '\\x85' single-quoted and reads it back as ' ' (found by tests/reliability/test_fuzz.py):
    such strings are written double-quoted, with escapes."""
    cfg = config_from_dict({}, [f"logging.run_name={json.dumps(name)}"])
    assert cfg.logging.run_name == name
    assert config_from_dict(yaml.safe_load(dump_yaml(cfg, redact=False))) == cfg
