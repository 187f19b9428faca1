import copy
import json

import pytest

from turnrl.chat.parity import WEATHER
from turnrl.chat.templates import GIL_FREE_CHARS, ChatTemplate, TemplateError, tool_prompt

CALC = {"type": "function", "function": {"name": "calculate", "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}


def with_template(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


# ------------------------------------------------------------------------------------------- SmolLM2 probes


def test_smollm2_probes(smol_template):
    t = smol_template
    assert t.assistant_suffix == "<|im_end|>\n"
    assert t.generation_prompt == "<|im_start|>assistant\n"
    assert t.stop_token_ids == (2,)
    assert t.native_tools is False          # SmolLM2's template ignores tools=
    assert t.renders_tool_role is True


def test_smollm2_render_encode_decode(smol_template):
    t = smol_template
    text = t.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = t.encode(text)
    assert ids[0] == 1 and ids.count(2) == 2    # special tokens are single ids, no BOS added
    assert t.decode(ids) == text
    ids2, offsets = t.encode_with_offsets("Hello world")
    assert ids2 == t.encode("Hello world") and offsets == [(0, 5), (5, 11)]


def test_the_direct_tokenizer_path_equals_the_wrapper(smol_template, smol_tokenizer):
    """`encode`, `encode_with_offsets` and `decode` call the Rust tokenizer straight when that is what the
    transformers wrapper would do: same ids, offsets and text, on text mixing special tokens, bytes and spaces."""
    import random
    t, tok = smol_template, smol_template.tokenizer
    assert t._direct
    rng = random.Random(0)
    texts = []
    pieces = ["<|im_start|>", "<|im_end|>", "\n", " ", "hello", "  world", "é", "日本", "<tool_call>", '{"a": 1}',
              "\t", "\n\n", " 42", "😀"]
    for k in range(300):   # every fourth long enough for the GIL-free batch call
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30) if k % 4 else rng.randint(90, 200)))
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = t.encode_with_offsets(text)
        assert t.encode(text) == ids == list(enc["input_ids"])
        assert offsets == [tuple(o) for o in enc["offset_mapping"]]
        cut = ids[:rng.randint(0, len(ids))]     # also half of a multi-byte character
        assert t.decode(cut) == tok.decode(cut, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        texts.append(text)
    assert t.encode_many(texts) == [t.encode(text) for text in texts]
    assert sum(len(text) >= GIL_FREE_CHARS for text in texts) >= 60


def test_the_wrapper_is_used_where_the_direct_path_would_differ(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)
    tok._tokenizer.enable_truncation(3)          # left on the backend by someone else's call
    t = ChatTemplate(tok)
    assert t._backend() is None
    assert len(t.encode("one two three four five")) == 5   # the wrapper turns truncation off for the call
    assert [len(ids) for ids in t.encode_many(["one two three four five", "six"])] == [5, 1]

    class Custom(type(smol_tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return "custom"
    tok = copy.deepcopy(smol_tokenizer)
    tok.__class__ = Custom
    t = ChatTemplate(tok)
    assert not t._direct and t.decode([1, 2]) == "custom"


def test_prompt_encoding_is_remembered_across_samples(smol_template):
    t = smol_template
    text = t.render([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True)
    hits = t._prompt_ids.cache_info().hits
    assert list(t.encode_prompt(text)) == t.encode(text)
    assert t.encode_prompt(text) is t.encode_prompt(text)        # the n samples of a task share one tokenization
    assert t._prompt_ids.cache_info().hits >= hits + 2


def test_tool_prompt_is_injected_into_existing_system_message(smol_template):
    messages = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "2+2?"}]
    prepared, render_tools = smol_template.prepare(messages, [CALC, WEATHER])
    assert render_tools is None                 # not native: the tools live in the system text
    assert messages[0]["content"] == "Be exact."  # the caller's messages are not modified
    system = prepared[0]["content"]
    assert system.startswith("Be exact.\n\n# Tools\n")
    assert system.endswith(tool_prompt([CALC, WEATHER]))
    lines = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in lines] == [CALC, WEATHER]   # one schema per line, exact
    assert "<tool_call>" in system and "<tool_response>" in system
    assert prepared[1:] == messages[1:]
    rendered = smol_template.render(prepared, render_tools, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nBe exact.\n\n# Tools") and '"name": "calculate"' in rendered


def test_tool_prompt_gets_its_own_system_message_when_there_is_none(smol_template):
    prepared, render_tools = smol_template.prepare([{"role": "user", "content": "hi"}], [CALC])
    assert render_tools is None
    assert prepared[0] == {"role": "system", "content": tool_prompt([CALC])}
    assert prepared[1] == {"role": "user", "content": "hi"}


def test_prepare_without_tools_changes_nothing(smol_template):
    messages = [{"role": "user", "content": "hi"}]
    prepared, render_tools = smol_template.prepare(messages, [])
    assert prepared == messages and prepared is not messages and render_tools is None


def test_tool_message(smol_template):
    assert smol_template.tool_message("calculate", "4", "call_0") == {
        "role": "tool", "name": "calculate", "content": "4", "tool_call_id": "call_0"}
    assert smol_template.tool_message("calculate", "4") == {"role": "tool", "name": "calculate", "content": "4"}


# ------------------------------------------------------------------------------------------- modes and errors


def test_tool_prompt_mode_overrides_the_probe(smol_tokenizer):
    assert ChatTemplate(smol_tokenizer, "native").native_tools is True
    assert ChatTemplate(smol_tokenizer, "inject").native_tools is False
    with pytest.raises(TemplateError, match="tool_prompt_mode must be auto, native or inject"):
        ChatTemplate(smol_tokenizer, "always")


def test_tokenizer_without_template(smol_tokenizer):
    with pytest.raises(TemplateError, match="has no chat template"):
        ChatTemplate(with_template(smol_tokenizer, None))


def test_template_that_rewrites_assistant_content(smol_tokenizer):
    t = ChatTemplate(with_template(smol_tokenizer, "{% for m in messages %}{{ m.content | lower }}{% endfor %}"))
    with pytest.raises(TemplateError, match="does not render assistant message content verbatim"):
        t.assistant_suffix


def test_generation_prompt_must_extend_the_render(smol_tokenizer):
    t = ChatTemplate(with_template(
        smol_tokenizer, "{% for m in messages %}{{ m.content }}{% endfor %}{% if not add_generation_prompt %}"
                        "<|im_end|>{% endif %}"))
    with pytest.raises(TemplateError, match="add_generation_prompt=True does not extend"):
        t.generation_prompt


def test_no_end_of_turn_token(smol_tokenizer):
    tok = with_template(smol_tokenizer, "{% for m in messages %}{{ m.content }}\n\n{% endfor %}")
    tok.eos_token = None
    t = ChatTemplate(tok)
    assert t.assistant_suffix == "\n\n"
    with pytest.raises(TemplateError, match="Found no end-of-turn token"):
        t.stop_token_ids


def test_template_without_tool_role_wraps_tool_results_as_user(smol_tokenizer):
    source = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
              "{{ raise_exception('unknown role ' + m.role) }}{% endif %}"
              "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}")
    t = ChatTemplate(with_template(smol_tokenizer, source))
    assert t.renders_tool_role is False
    assert t.native_tools is False
    assert t.tool_message("calculate", "4", "call_0") == {
        "role": "user", "content": "<tool_response>\n4\n</tool_response>"}


def test_template_that_breaks_on_tools_is_not_native(smol_tokenizer):
    source = ("{% if tools %}{{ raise_exception('no tools') }}{% endif %}"
              "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}")
    assert ChatTemplate(with_template(smol_tokenizer, source)).native_tools is False


# ------------------------------------------------------------------------------------------- other families


def test_chatml_with_native_tools_probes(chatml_tools):
    t = chatml_tools
    assert t.assistant_suffix == "<|im_end|>\n"
    assert t.generation_prompt == "<|im_start|>assistant\n"
    assert t.stop_token_ids == (2,)
    assert t.native_tools is True and t.renders_tool_role is True
    messages, render_tools = t.prepare([{"role": "user", "content": "hi"}], [WEATHER])
    assert messages == [{"role": "user", "content": "hi"}] and render_tools == [WEATHER]
    text = t.render(messages, render_tools)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert json.dumps(WEATHER) in text


def test_chatml_groups_consecutive_tool_results(chatml_tools):
    text = chatml_tools.render([
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "calls"},
        {"role": "tool", "content": "A"}, {"role": "tool", "content": "B"}])
    assert text.endswith("<|im_start|>user\n<tool_response>\nA\n</tool_response>\n"
                         "<tool_response>\nB\n</tool_response><|im_end|>\n")


def test_llama3_probes(llama3):
    t = llama3
    eot = t.tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert t.encode("<|eot_id|>") == [eot]
    assert t.assistant_suffix == "<|eot_id|>"
    assert t.generation_prompt == "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert t.stop_token_ids == (eot, 2)       # the end-of-turn token first, then the tokenizer's EOS
    assert t.native_tools is False and t.renders_tool_role is True
    text = t.render([{"role": "user", "content": "  padded \n"}], add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\npadded<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_strip_thinking_probes_and_behaviour(strip_thinking):
    t = strip_thinking
    assert t.assistant_suffix == "<|im_end|>\n" and t.stop_token_ids == (2,) and t.native_tools is False
    convo = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>x</think>\n\nA"}]
    assert "<think>x</think>" in t.render(convo)
    assert "<think>" not in t.render(convo + [{"role": "user", "content": "b"}])


# ------------------------------------------------------------------------------------------- kwargs, reasoning


def qwen3(smol_tokenizer, **kwargs):
    from families import FAMILIES, family_tokenizer
    return ChatTemplate(family_tokenizer(smol_tokenizer, FAMILIES["qwen3"]), template_kwargs=kwargs)


def test_template_kwargs_reach_the_template(smol_tokenizer):
    user = [{"role": "user", "content": "hi"}]
    assert qwen3(smol_tokenizer).render(user, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    off = qwen3(smol_tokenizer, enable_thinking=False)
    assert off.render(user, add_generation_prompt=True).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.generation_prompt == "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_template_kwargs_are_checked(smol_tokenizer):
    with pytest.raises(TemplateError, match=r"never reads \['enable_thinkng'\]: drop them"):
        qwen3(smol_tokenizer, enable_thinkng=False)
    with pytest.raises(TemplateError, match=r"cannot set \['tools'\]: turnrl passes those itself"):
        qwen3(smol_tokenizer, tools=[])


def test_reasoning_splits_and_joins_exactly(smol_template, smol_tokenizer):
    t = smol_template
    for text, reasoning, answer in [("<think>\nplan\n</think>\n\n42", "\nplan\n", "\n\n42"),
                                    ("<think></think>x", "", "x"),
                                    ("42", None, "42"),
                                    (" <think>a</think>b", None, " <think>a</think>b"),   # not leading
                                    ("<think>unfinished", None, "<think>unfinished"),
                                    ("<think>a<think>b</think>c", None, "<think>a<think>b</think>c")]:
        assert t.split_reasoning(text) == (reasoning, answer)
        message = {"role": "assistant", "content": answer}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        assert t.join_reasoning(message)["content"] == text
        assert "reasoning_content" not in t.join_reasoning(message)
    # A prompt that opens the thinking block (DeepSeek-R1 style): the reply only closes it.
    opens = copy.deepcopy(smol_tokenizer)
    opens.chat_template = smol_tokenizer.chat_template.replace(
        "{{ '<|im_start|>assistant\n' }}", "{{ '<|im_start|>assistant\n<think>\n' }}")
    o = ChatTemplate(opens)
    assert o.prompt_opens_thinking and not t.prompt_opens_thinking
    assert o.split_reasoning("plan\n</think>\n\n42") == ("plan\n", "\n\n42")
    assert o.join_reasoning({"role": "assistant", "content": "\n\n42", "reasoning_content": "plan\n"})["content"] \
        == "plan\n</think>\n\n42"


def test_qwen3_reads_the_reasoning_the_session_keeps_apart(smol_tokenizer):
    """Qwen3 renders the latest turn's reasoning and drops older ones; rendering the split message gives what
    rendering the raw text gives, both ways."""
    t = qwen3(smol_tokenizer)
    raw = [{"role": "user", "content": "6*7?"}, {"role": "assistant", "content": "<think>\nsix sevens\n</think>\n\n42"}]
    split = [raw[0], {"role": "assistant", "content": "\n\n42", "reasoning_content": "\nsix sevens\n"}]
    more = [{"role": "user", "content": "and 6*8?"}]
    assert t.render(split) == t.render(raw) and "six sevens" in t.render(split)
    assert t.render(split + more) == t.render(raw + more) and "six sevens" not in t.render(split + more)
