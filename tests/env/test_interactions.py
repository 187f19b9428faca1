"""Interactions: reply shapes, the last assistant message, and loading by name or YAML."""

import textwrap

import pytest

from turnrl.config.loader import ConfigError
from turnrl.config.schema import InteractionSpec
from turnrl.env.interactions import Interaction, Reply, as_reply, last_assistant_text
from turnrl.env.loading import interaction_factory, read_interaction_config


def test_as_reply_accepts_reply_tuple_and_string():
    reply = Reply("hi", done=True, reward=0.5, info={"k": 1})
    assert as_reply(reply) is reply
    assert as_reply("again?") == Reply("again?", False, 0.0, {})
    assert as_reply(("bye", True)) == Reply("bye", True, 0.0, {})
    assert as_reply(("ok", 1, "0.25", {"a": 2})) == Reply("ok", True, 0.25, {"a": 2})
    assert as_reply(("ok", False, None, None)) == Reply("ok", False, 0.0, {})


@pytest.mark.parametrize("bad", [None, 3, ("a", False, 0.0, {}, "extra"), ()])
def test_as_reply_rejects_other_shapes(bad):
    with pytest.raises(TypeError, match="must return Reply"):
        as_reply(bad)


def test_as_reply_names_the_verl_order_mistake():
    with pytest.raises(TypeError, match="verl's \\(terminate, text, score, extra\\) order"):
        as_reply((False, "Try again.", 0.0, {}))
    with pytest.raises(TypeError, match="reply text must be a string, got int"):
        as_reply((42, True))


def test_last_assistant_text():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "first"},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": None}]
    assert last_assistant_text(messages) == ""
    assert last_assistant_text(messages[:3]) == "first"
    assert last_assistant_text([{"role": "user", "content": "q"}]) == ""


class Echo:
    def __init__(self, prefix: str = ">"):
        self.prefix = prefix
        self.started = None

    def start(self, **kwargs):
        self.started = kwargs

    def respond(self, messages):
        return f"{self.prefix} {last_assistant_text(messages)}"

    def finish(self):
        return 1.0


def test_interaction_factory_builtin_module_and_fresh_instances():
    make = interaction_factory(InteractionSpec(name="fb", class_name="math_feedback", config={"max_attempts": 5}))
    a, b = make(), make()
    assert a is not b and a.max_attempts == 5 and type(a).__name__ == "MathFeedback"
    make = interaction_factory(InteractionSpec(name="echo", class_name=f"{__name__}:Echo", config={"prefix": "!"}))
    echo = make()
    assert isinstance(echo, Interaction)
    assert as_reply(echo.respond([{"role": "assistant", "content": "x"}])).text == "! x"


def test_read_interaction_config_in_verls_shape(tmp_path):
    path = tmp_path / "interaction.yaml"
    path.write_text(textwrap.dedent(f'''
        interaction:
          - name: echo
            class_name: {__name__}.Echo
            config: {{prefix: "#"}}
          - name: guess
            class_name: guess_number
    '''))
    specs = read_interaction_config(str(path))
    assert [(s.name, s.class_name) for s in specs] == [("echo", f"{__name__}.Echo"), ("guess", "guess_number")]
    assert interaction_factory(specs[0])().prefix == "#"


def test_bad_interaction_names(tmp_path):
    with pytest.raises(ConfigError, match="unknown interaction 'guess_numbr'. Did you mean 'guess_number'"):
        interaction_factory(InteractionSpec(name="x", class_name="guess_numbr"))
    with pytest.raises(ConfigError, match="is not a class"):
        interaction_factory(InteractionSpec(name="x", class_name="turnrl.env.interactions:as_reply"))
    with pytest.raises(ConfigError, match="cannot import module"):
        interaction_factory(InteractionSpec(name="x", class_name="no_such_module_zq:User"))
    path = tmp_path / "interaction.yaml"
    path.write_text("interaction:\n  - class_name: guess_number\n")
    with pytest.raises(ConfigError, match="name"):
        read_interaction_config(str(path))
