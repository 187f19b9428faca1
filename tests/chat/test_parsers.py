import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.chat.parsers import PARSERS, HermesParser, Llama3JsonParser, get_parser, strip_reasoning
from turnrl.ledger import ToolCall

hermes = HermesParser()
llama3 = Llama3JsonParser()


def summary(calls):
    return [(c.name, c.arguments, c.error) for c in calls]


# ------------------------------------------------------------------------------------------- hermes


def test_hermes_single_call():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>'
    (call,) = hermes.parse(text)
    assert call == ToolCall("calculate", {"expression": "2+3"},
                            '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>',
                            "call_0")


def test_hermes_parallel_calls_keep_order_and_ids():
    text = ''.join(f'<tool_call>{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}</tool_call>\n'
                   for c in ("Oslo", "Lima", "Rome"))
    calls = hermes.parse(text)
    assert summary(calls) == [("get_weather", {"city": c}, None) for c in ("Oslo", "Lima", "Rome")]
    assert [c.id for c in calls] == ["call_0", "call_1", "call_2"]


def test_hermes_calls_inside_reasoning_are_ignored():
    text = ('<think>Maybe <tool_call>{"name": "wrong", "arguments": {}}</tool_call>? No.</think>\n'
            '<tool_call>{"name": "right", "arguments": {"x": 1}}</tool_call>')
    assert summary(hermes.parse(text)) == [("right", {"x": 1}, None)]
    # Unterminated reasoning: everything after <think> is still thinking.
    assert hermes.parse('<think>plan: <tool_call>{"name": "a", "arguments": {}}</tool_call>') == []
    assert strip_reasoning("a<think>b</think>c<think>d") == "ac"


def test_hermes_plain_text_has_no_calls():
    assert hermes.parse("The answer is 5.") == []
    assert hermes.parse("") == []


@pytest.mark.parametrize("body, name, error", [
    ('{"name": "calc", "arguments": {"x": 1}', "", "malformed JSON in <tool_call>: Expecting ',' delimiter"),
    ("calc(x=1)", "", "malformed JSON in <tool_call>: Expecting value"),
    ('{"arguments": {"x": 1}}', "", "the tool call has no 'name' string"),
    ('{"name": "", "arguments": {}}', "", "the tool call has no 'name' string"),
    ('{"name": 7, "arguments": {}}', "", "the tool call has no 'name' string"),
    ('["calc", {"x": 1}]', "", "a tool call must be a JSON object with 'name' and 'arguments'"),
    ('{"name": "calc", "arguments": [1, 2]}', "calc", "'arguments' must be a JSON object"),
    ('{"name": "calc", "arguments": 3}', "calc", "'arguments' must be a JSON object"),
    ('{"name": "calc", "arguments": "{\\"x\\": "}', "calc", "arguments are not valid JSON: Expecting value"),
    ('{"name": "calc", "arguments": "[1]"}', "calc", "'arguments' must be a JSON object"),
])
def test_hermes_bad_calls_are_returned_with_an_error(body, name, error):
    (call,) = hermes.parse(f"<tool_call>{body}</tool_call>")
    assert call.name == name and call.arguments is None
    assert call.error.startswith(error)
    assert call.raw == f"<tool_call>{body}</tool_call>"


def test_hermes_arguments_as_json_string_or_missing():
    calls = hermes.parse('<tool_call>{"name": "calc", "arguments": "{\\"x\\": 2}"}</tool_call>'
                         '<tool_call>{"name": "now"}</tool_call>'
                         '<tool_call>{"name": "now", "arguments": null}</tool_call>'
                         '<tool_call>{"name": "now", "arguments": " "}</tool_call>')
    assert summary(calls) == [("calc", {"x": 2}, None), ("now", {}, None), ("now", {}, None), ("now", {}, None)]


def test_hermes_unterminated_call():
    calls = hermes.parse('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "argu')
    assert summary(calls)[0] == ("a", {}, None)
    assert calls[1].error == "unterminated <tool_call> (no </tool_call>)" and calls[1].arguments is None
    assert calls[1].raw.startswith('<tool_call>{"name": "b"')


def test_hermes_deeply_nested_json_is_an_error_not_a_crash():
    (call,) = hermes.parse("<tool_call>" + "[" * 50_000 + "</tool_call>")
    assert call.error == "malformed JSON in <tool_call>: JSON nested too deeply"
    (call,) = hermes.parse('<tool_call>{"name": "a", "arguments": "' + "[" * 50_000 + '"}</tool_call>')
    assert call.name == "a" and call.error == "arguments are not valid JSON: JSON nested too deeply"


# ------------------------------------------------------------------------------------------- llama3_json


def test_llama3_single_object():
    (call,) = llama3.parse('{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert (call.name, call.arguments, call.error, call.id) == ("get_weather", {"city": "Oslo"}, None, "call_0")
    assert json.loads(call.raw) == {"name": "get_weather", "parameters": {"city": "Oslo"}}


def test_llama3_accepts_arguments_key_too():
    assert summary(llama3.parse('{"name": "f", "arguments": {"a": 1}}')) == [("f", {"a": 1}, None)]


def test_llama3_list_python_tag_and_semicolons():
    expected = [("a", {"x": 1}, None), ("b", {}, None)]
    assert summary(llama3.parse('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]')) == expected
    tagged = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert summary(llama3.parse(tagged)) == expected
    assert summary(llama3.parse('  {"name": "a", "parameters": {"x": 1}};\n{"name": "b", "parameters": {}};  ')) \
        == expected
    calls = llama3.parse('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert [c.id for c in calls] == ["call_0", "call_1"]


def test_llama3_semicolon_inside_a_string_stays_in_the_argument():
    calls = llama3.parse('{"name": "sql", "parameters": {"q": "SELECT 1; SELECT 2"}}; {"name": "b", "parameters": {}}')
    assert summary(calls) == [("sql", {"q": "SELECT 1; SELECT 2"}, None), ("b", {}, None)]


@pytest.mark.parametrize("text", ["The weather is nice.", "Call get_weather for Oslo.", "", "   ",
                                  '<think>{"name": "a", "parameters": {}}</think>It is sunny.'])
def test_llama3_plain_text_has_no_calls(text):
    assert llama3.parse(text) == []


def test_llama3_reasoning_before_the_call_is_skipped():
    assert summary(llama3.parse('<think>which tool?</think>\n{"name": "a", "parameters": {}}')) == [("a", {}, None)]


@pytest.mark.parametrize("text, error", [
    ('{"name": "a", "parameters": {', "malformed JSON tool call: Expecting"),
    ('{"name": "a"} {"name": "b"}', "malformed JSON tool call: expected ';' between tool calls"),
    ('{"name": "a"}; oops', "malformed JSON tool call: Expecting value"),
    ("[" * 50_000, "malformed JSON tool call: JSON nested too deeply"),
])
def test_llama3_malformed(text, error):
    (call,) = llama3.parse(text)
    assert call.name == "" and call.arguments is None and call.error.startswith(error)


def test_llama3_bad_objects_carry_errors():
    calls = llama3.parse('[{"name": "a", "parameters": [1]}, 5, {"parameters": {}}]')
    assert summary(calls) == [("a", None, "'parameters' must be a JSON object"),
                              ("", None, "a tool call must be a JSON object with 'name' and 'parameters'"),
                              ("", None, "the tool call has no 'name' string")]


# ------------------------------------------------------------------------------------------- registry


def test_get_parser():
    assert isinstance(get_parser("hermes"), HermesParser)
    assert isinstance(get_parser("llama3_json"), Llama3JsonParser)
    with pytest.raises(ValueError, match=r"Unknown tool_parser 'nope'\. Known parsers: hermes, llama3_json\."):
        get_parser("nope")


# ------------------------------------------------------------------------------------------- property


FRAGMENTS = st.sampled_from(["<tool_call>", "</tool_call>", "<think>", "</think>", "<|python_tag|>", "{", "}",
                             "[", "]", ";", '"name"', '"arguments"', '"parameters"', ":", ",", '"', "\\", "null",
                             "\n", " ", "1", "calc", "{}", '"x"'])
TEXTS = st.one_of(st.text(max_size=200), st.lists(st.one_of(FRAGMENTS, st.text(max_size=5)), max_size=40).map("".join))


@settings(max_examples=400, deadline=None)
@given(TEXTS, st.sampled_from(sorted(PARSERS)))
def test_parse_never_raises(text, name):
    calls = get_parser(name).parse(text)
    assert isinstance(calls, list)
    for i, call in enumerate(calls):
        assert isinstance(call, ToolCall) and call.id == f"call_{i}"
        # Either a usable call or an explained failure, never both or neither.
        assert (call.error is None) == (isinstance(call.arguments, dict) and bool(call.name))
