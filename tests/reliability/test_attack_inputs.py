"""Bad input gets an error that names the file and says what to do (issue 17 item 8)."""

from pathlib import Path

import pytest

from turnrl.config import ConfigError, load_config
from turnrl.data import DataError
from turnrl.data.rows import load_rows

ROOT = Path(__file__).parents[2]


def test_an_unknown_tool_parser_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.tool_parser=hermess"])
    assert "tool_parser" in str(err.value) and "hermes" in str(err.value)


def test_the_tool_parser_choices_are_the_parsers():
    import typing

    from turnrl.chat.parsers import PARSERS
    from turnrl.config.schema import RolloutConfig
    assert set(typing.get_args(typing.get_type_hints(RolloutConfig)["tool_parser"])) == set(PARSERS) | {"auto"}


def test_examples_name_only_real_keys():
    text = (ROOT / "examples" / "collab" / "train.yaml").read_text()
    assert "api_key_env" not in text


@pytest.mark.parametrize("yaml_text", ["a: &x [*x]\n", "model: &m {lora: *m}\n"])
def test_a_self_referencing_yaml_alias_is_a_short_config_error(tmp_path, yaml_text):
    path = tmp_path / "loop.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path), [])
    assert str(path) in str(err.value) and "refers to itself" in str(err.value)


def test_bad_data_paths_are_errors_that_name_the_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    fake = tmp_path / "rows.parquet"
    fake.write_text('{"not": "parquet"}\n')
    folder = tmp_path / "data.jsonl"
    folder.mkdir()
    for path, what in ((empty, "holds no rows"), (fake, "is not a Parquet file"), (folder, "is a directory")):
        with pytest.raises(DataError) as err:
            load_rows(path)
        assert str(path) in str(err.value) and what in str(err.value), err.value
