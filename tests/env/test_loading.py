"""Loading tools by name: built-ins, `module:attr` and `file.py:attr` names, verl's tool YAML, schema overrides,
and the config errors for names, files and configs that do not load."""

import asyncio
import json
import textwrap

import pytest

from turnrl.config.loader import ConfigError
from turnrl.config.schema import ToolSpec
from turnrl.env.loading import import_object, read_tool_config, tool_factory
from turnrl.env.tools import ToolOutput, ToolSession
from turnrl.ledger import ToolCall


class Stepper:
    """A class tool with a schema of its own (a file or module name points at it)."""
    name = "stepper"
    schema = {"type": "function", "function": {"name": "stepper", "description": "count",
              "parameters": {"type": "object", "properties": {"step": {"type": "integer"}}}}}

    def __init__(self):
        self.total = 0

    def execute(self, args):
        self.total += args.get("step", 1)
        return ToolOutput(str(self.total))


def call(name, args, i=0):
    return ToolCall(name, args, json.dumps({"name": name, "arguments": args}), f"call_{i}")


class NotATool:
    name = "not_a_tool"
    schema = {}


# -- loading by name ------------------------------------------------------------------------------------
def test_builtin_and_module_names():
    name, make = tool_factory(ToolSpec(class_name="calculator"))
    assert name == "calculator" and make().execute({"expression": "2*3"}).text == "6"
    name, make = tool_factory(ToolSpec(class_name="turnrl.env.builtin.checker:AnswerChecker",
                                       config={"max_submissions": 1}))
    assert name == "check_answer" and make().max_submissions == 1
    assert import_object("turnrl.env.builtin.calculator.Calculator").name == "calculator"


def test_file_tool_written_in_tmp_path(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(textwrap.dedent('''
        def shout(text: str) -> str:
            """Upper-case the text.

            Args:
                text: what to shout
            """
            return text.upper()
    '''))
    name, make = tool_factory(ToolSpec(class_name=f"{path}:shout"))
    tool = make()
    assert name == "shout"
    assert tool.schema["function"]["parameters"]["properties"]["text"]["description"] == "what to shout"
    session = ToolSession({"shout": tool})
    assert asyncio.run(session.execute_all([call("shout", {"text": "hi"})]))[0].text == "HI"


def test_tool_schema_override_renames_a_class_tool():
    custom = {"type": "function", "function": {"name": "add_up", "description": "d",
              "parameters": {"type": "object", "properties": {"step": {"type": "integer"}}}}}
    name, make = tool_factory(ToolSpec(class_name=f"{__name__}:Stepper", tool_schema=custom))
    tool = make()
    assert name == "add_up" and tool.name == "add_up" and tool.schema is custom


def test_read_tool_config_in_verls_shape(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(f'''
        tools:
          - class_name: calculator
            config: {{}}
          - class_name: {__name__}.Stepper
            tool_schema:
              type: function
              function:
                name: counter
                description: count up
                parameters: {{type: object, properties: {{step: {{type: integer}}}}, required: []}}
    '''))
    specs = read_tool_config(str(path))
    assert [s.class_name for s in specs] == ["calculator", f"{__name__}.Stepper"]
    assert specs[1].tool_schema["function"]["description"] == "count up"
    assert [tool_factory(s)[0] for s in specs] == ["calculator", "counter"]


@pytest.mark.parametrize("name, message", [
    ("nonsense", "unknown tool 'nonsense'. Built-ins: calculator, check_answer"),
    ("calculater", "Did you mean 'calculator'?"),
    ("no_such_module_zq:Tool", "cannot import module 'no_such_module_zq'"),
    ("turnrl.env.tools:NoSuchThing", "has no attribute 'NoSuchThing'"),
    ("/nowhere/tools.py:Tool", "does not exist"),
])
def test_bad_tool_names_are_config_errors(name, message):
    with pytest.raises(ConfigError, match=message):
        tool_factory(ToolSpec(class_name=name))


def test_bad_tool_files_and_configs(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1\nraise RuntimeError('import-time failure')\n")
    for _ in range(2):  # the half-run module is not cached: the second lookup fails the same way
        with pytest.raises(ConfigError, match="RuntimeError: import-time failure"):
            import_object(f"{broken}:x")
    with pytest.raises(ConfigError, match="is a function: it takes no 'config'"):
        tool_factory(ToolSpec(class_name="turnrl.rewards.answers:as_number", config={"x": 1}))
    with pytest.raises(ConfigError, match="has no function name"):
        tool_factory(ToolSpec(class_name="calculator", tool_schema={"type": "function", "function": {}}))
    with pytest.raises(ConfigError, match="has no 'execute'"):
        tool_factory(ToolSpec(class_name=f"{__name__}:NotATool"))
    with pytest.raises(ConfigError, match="cannot be built with config {'colour': 'red'}: TypeError"):
        tool_factory(ToolSpec(class_name="calculator", config={"colour": "red"}))
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("tool: []\n")
    with pytest.raises(ConfigError, match="top-level 'tools:' list"):
        read_tool_config(str(bad_yaml))
    with pytest.raises(ConfigError, match="does not exist"):
        read_tool_config(str(tmp_path / "missing.yaml"))
    unknown_key = tmp_path / "unknown.yaml"
    unknown_key.write_text("tools:\n  - class_name: calculator\n    confg: {}\n")
    with pytest.raises(ConfigError, match="confg"):
        read_tool_config(str(unknown_key))
