import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from families import FAMILIES, family_tokenizer, rendered_assistant_text
from turnrl.chat.parsers import (PARSERS, CannotForce, DeepSeekV3Parser, HermesParser, Llama3JsonParser, MistralParser,
                                 PythonicParser, Qwen3CoderParser, get_parser, strip_reasoning)
from turnrl.chat.templates import ChatTemplate
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
    with pytest.raises(ValueError, match=r"Unknown tool_parser 'nope'\. Known parsers: hermes, llama3_json, "
                                         r"qwen3_coder, pythonic, mistral, deepseek_v3, or 'auto'\."):
        get_parser("nope")


# ------------------------------------------------------------------------------------------- property


FRAGMENTS = st.sampled_from(["<tool_call>", "</tool_call>", "<think>", "</think>", "<|python_tag|>", "{", "}",
                             "[", "]", ";", '"name"', '"arguments"', '"parameters"', ":", ",", '"', "\\", "null",
                             "\n", " ", "1", "calc", "{}", '"x"',
                             # qwen3_coder, pythonic, mistral, deepseek_v3
                             "<function=calc>", "</function>", "<parameter=x>", "</parameter>", "<function=",
                             "<parameter=", ">", "f(", "(", ")", "=", "x=1", "**", "'", "<|python_start|>",
                             "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
                             "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "function", "```json", "```"])
TEXTS = st.one_of(st.text(max_size=200), st.lists(st.one_of(FRAGMENTS, st.text(max_size=5)), max_size=40).map("".join))


@settings(max_examples=1200, deadline=None)
@given(TEXTS, st.sampled_from(sorted(PARSERS)))
def test_parse_never_raises(text, name):
    calls = get_parser(name).parse(text)
    assert isinstance(calls, list)
    for i, call in enumerate(calls):
        assert isinstance(call, ToolCall) and call.id == f"call_{i}"
        # Either a usable call or an explained failure, never both or neither.
        assert (call.error is None) == (isinstance(call.arguments, dict) and bool(call.name))


# ------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trip_through_the_published_template(family, smol_tokenizer):
    """The family's template renders an assistant tool call; the model would sample those tokens up to its
    end-of-turn token; the family's parser reads the same calls back from the decoded tokens."""
    fam = FAMILIES[family]
    tok = family_tokenizer(smol_tokenizer, fam)
    template = ChatTemplate(tok)
    ids = template.encode(rendered_assistant_text(tok, fam))
    stop = next((i for i, t in enumerate(ids) if t in template.stop_token_ids), len(ids))
    sampled = template.decode(ids[:stop])
    calls = get_parser(fam.parser).parse(sampled)
    assert summary(calls) == [(name, args, None) for name, args in fam.calls], sampled
    assert [c.id for c in calls] == [f"call_{i}" for i in range(len(fam.calls))]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_parsers_do_not_read_a_family_s_calls(family, smol_tokenizer):
    fam = FAMILIES[family]
    text = rendered_assistant_text(family_tokenizer(smol_tokenizer, fam), fam)
    for name in PARSERS:
        if name != fam.parser:
            assert not [c for c in get_parser(name).parse(text) if c.error is None], name


# ------------------------------------------------------------------------------------------- qwen3_coder


qwen3_coder = Qwen3CoderParser()


def test_qwen3_coder_values_and_text_before_the_call():
    text = ("I'll look it up.\n<tool_call>\n<function=f>\n<parameter=s>\n  two\nlines  \n</parameter>\n"
            "<parameter=n>\n-2.5\n</parameter>\n<parameter=b>\nTrue\n</parameter>\n<parameter=o>\n{\"a\": [1]}\n"
            "</parameter>\n<parameter=none>\nNone\n</parameter>\n</function>\n</tool_call>")
    assert summary(qwen3_coder.parse(text)) == [
        ("f", {"s": "  two\nlines  ", "n": -2.5, "b": True, "o": {"a": [1]}, "none": None}, None)]


@pytest.mark.parametrize("text, name, error", [
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>", "", "unterminated <tool_call>"),
    ("<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "", "<tool_call> holds no <function=NAME> block"),
    ("<tool_call>\n<function=>\n</function>\n</tool_call>", "", "<function=...> has no name"),
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</tool_call>", "f", "<function=f> is not closed"),
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>", "f",
     "<parameter=a> is not closed"),
])
def test_qwen3_coder_malformed(text, name, error):
    (call,) = qwen3_coder.parse(text)
    assert call.name == name and call.arguments is None and call.error.startswith(error)


# ------------------------------------------------------------------------------------------- pythonic


pythonic = PythonicParser()


def test_pythonic_calls_with_prose_tags_and_nested_literals():
    text = ('Checking both.<|python_start|>[get_weather(city="Oslo", days=2), api.search(q=\'a, b\', '
            'filters={"lang": ["en"]}, limit=None)]<|python_end|>')
    assert summary(pythonic.parse(text)) == [("get_weather", {"city": "Oslo", "days": 2}, None),
                                             ("api.search", {"q": "a, b", "filters": {"lang": ["en"]}, "limit": None},
                                              None)]


@pytest.mark.parametrize("text", ["The answer is [1, 2].", "See [the docs](x) [f]", "[]", "no brackets",
                                  "Call [f(x=1)] first, then tell me.", "<think>[f(a=1)]</think>done"])
def test_pythonic_plain_text_has_no_calls(text):
    assert pythonic.parse(text) == []


@pytest.mark.parametrize("text, name, error", [
    ("[get_weather(city=Paris)]", "get_weather", "get_weather: argument 'city' is not a Python literal"),
    ("[f(1, 2)]", "f", "f: write the arguments as keywords"),
    ("[f(**kw)]", "f", "f: '**' arguments are not allowed"),
    ("[f(a=1), g(b=]", "", "not a Python list of calls: SyntaxError"),
    ("[f(a=__import__('os').system('x'))]", "f", "f: argument 'a' is not a Python literal"),
])
def test_pythonic_malformed(text, name, error):
    (call,) = pythonic.parse(text)
    assert call.name == name and call.arguments is None and call.error.startswith(error)


def test_pythonic_mixed_list_and_deep_nesting_are_errors():
    (call,) = pythonic.parse("[f(a=1), 2]")
    assert call.error == 'every item of the list must be a call, e.g. [f(a=1), g(b="x")]'
    (call,) = pythonic.parse("[f(a=" + "[" * 100_000 + "]" * 100_000 + ")]")
    assert call.arguments is None and call.error


# ------------------------------------------------------------------------------------------- mistral


mistral = MistralParser()


def test_mistral_v11_named_calls_and_string_arguments():
    assert summary(mistral.parse('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[CALL_ID]x12345678[ARGS]{}')) == [
        ("f", {"a": 1}, None), ("g", {}, None)]
    assert summary(mistral.parse('Sure. [TOOL_CALLS] [{"name": "f", "arguments": "{\\"a\\": 2}"}]')) == [
        ("f", {"a": 2}, None)]


@pytest.mark.parametrize("text, name, error", [
    ("[TOOL_CALLS] [{\"name\": \"f\", ", "", "malformed JSON after [TOOL_CALLS]"),
    ("[TOOL_CALLS] []", "", "[TOOL_CALLS] is followed by an empty list"),
    ("[TOOL_CALLS] get_weather", "", "[TOOL_CALLS] must be followed by a JSON list or by NAME[ARGS]{...}"),
    ("[TOOL_CALLS][ARGS]{}", "", "the tool call has no name before [ARGS]"),
    ("[TOOL_CALLS]f[ARGS]{\"a\": ", "f", "arguments are not valid JSON"),
    ("[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": [1]}]", "f", "'arguments' must be a JSON object"),
])
def test_mistral_malformed(text, name, error):
    (call,) = mistral.parse(text)
    assert call.name == name and call.arguments is None and call.error.startswith(error)


# ------------------------------------------------------------------------------------------- deepseek_v3


deepseek = DeepSeekV3Parser()
DS = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"


def test_deepseek_v31_form():
    assert summary(deepseek.parse(DS.format('get_weather<｜tool▁sep｜>{"city": "Rome"}'))) == [
        ("get_weather", {"city": "Rome"}, None)]


@pytest.mark.parametrize("inner, name, error", [
    ("function<｜tool▁sep｜>f\n```json\n{\"a\": \n```", "f", "arguments are not valid JSON"),
    ("function get_weather", "", "the tool call has no <｜tool▁sep｜>"),
    ("<｜tool▁sep｜>{}", "", "the tool call has no name"),
])
def test_deepseek_malformed(inner, name, error):
    (call,) = deepseek.parse(DS.format(inner))
    assert call.name == name and call.arguments is None and call.error.startswith(error)
    (call,) = deepseek.parse("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}")
    assert call.error.startswith("unterminated tool call")


# ------------------------------------------------------------------------------------------- forced openings


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forced_opening_is_how_the_published_template_starts_a_call(family, smol_tokenizer):
    """`tool_choice: required` / a named function put the parser's opening ahead of the reply: it must be what
    the family's template writes, reasoning aside, so the model continues a call it was trained to write."""
    fam = FAMILIES[family]
    written = rendered_assistant_text(family_tokenizer(smol_tokenizer, fam), fam).split("</think>")[-1].lstrip()
    parser = get_parser(fam.parser)
    assert parser.name == fam.parser
    assert written.startswith(parser.forced_opening(None)), written
    try:
        named = parser.forced_opening(fam.calls[0][0])
    except CannotForce:
        assert fam.parser in ("mistral", "deepseek_v3")   # the named syntax depends on the model's version
    else:
        assert written.startswith(named) and fam.calls[0][0] in named, (named, written)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_forced_opening_then_a_call_parses_as_that_call(name):
    rest = {"hermes": ('get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                       ' {"city": "Paris"}}\n</tool_call>'),
            "llama3_json": ('get_weather", "parameters": {"city": "Paris"}}', ' {"city": "Paris"}}'),
            "qwen3_coder": ("get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
                            "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
            "pythonic": ('get_weather(city="Paris")]', 'city="Paris")]'),
            "mistral": (' [{"name": "get_weather", "arguments": {"city": "Paris"}}]', None),
            "deepseek_v3": ('get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                            None)}
    parser = get_parser(name)
    required, named = rest[name]
    assert summary(parser.parse(parser.forced_opening(None) + required)) == [("get_weather", {"city": "Paris"}, None)]
    if named is None:
        with pytest.raises(CannotForce, match="cannot tell"):
            parser.forced_opening("get_weather")
    else:
        assert summary(parser.parse(parser.forced_opening("get_weather") + named)) == \
            [("get_weather", {"city": "Paris"}, None)]
