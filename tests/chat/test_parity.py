import shutil

import pytest

from turnrl.chat.parity import SYNTHETIC, WEATHER, check_conversation, check_template, token_diff
from turnrl.cli import main
from turnrl.ledger import Source

NAMES = list(SYNTHETIC)


def results(reports):
    assert [r.name for r in reports] == NAMES
    return {r.name: r.result for r in reports}


def replace_run(ids, old, new):
    out, i = [], 0
    while i < len(ids):
        if ids[i:i + len(old)] == old:
            out += new
            i += len(old)
        else:
            out.append(ids[i])
            i += 1
    return out


# ------------------------------------------------------------------------------------------- SmolLM2


def test_smollm2_is_exact_on_every_synthetic_conversation(smol_template):
    reports = check_template(smol_template)
    assert results(reports) == dict.fromkeys(NAMES, "exact")
    assert all(r.detail == "" for r in reports)


@pytest.mark.parametrize("name", NAMES)
def test_synthetic_ledgers_equal_the_full_render(smol_template, name):
    messages, tools = SYNTHETIC[name]
    report, traj = check_conversation(smol_template, messages, tools, name=name)
    assert report.result == "exact" and traj.parity == "exact"
    t = smol_template
    assert traj.segment.token_ids == t.encode(t.render(traj.messages))
    # the reasoning is kept apart (reasoning_content) and joins back to the text as sampled
    assert [t.join_reasoning(m)["content"] for m in traj.messages if m["role"] == "assistant"] == \
        [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(traj.turns) == sum(m["role"] == "assistant" for m in messages)
    traj.check()


def test_conversation_ending_with_a_tool_result_ends_with_generation_prompt(smol_template):
    messages = SYNTHETIC["tool_call"][0][:3]
    report, traj = check_conversation(smol_template, messages, [WEATHER])
    assert report.result == "exact"
    assert smol_template.decode(traj.segment.token_ids).endswith("<|im_start|>assistant\n")


def test_cli_check_template_passes_for_smollm2(capsys):
    assert main(["check-template", "smollm2-135m-instruct"]) == 0
    out = capsys.readouterr().out
    assert "assistant suffix '<|im_end|>\\n', stop tokens [2], tools injected" in out
    for name in NAMES:
        assert f"PASS {name:20s} exact" in out
    assert "FAIL" not in out


def test_cli_check_template_fails_for_non_append_only_template(tmp_path, capsys, smollm2_dir, strip_thinking):
    strip_thinking.tokenizer.save_pretrained(tmp_path)
    shutil.copy(smollm2_dir / "config.json", tmp_path)
    assert main(["check-template", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {'reasoning':20s} mismatch" in out and "not append-only" in out
    assert f"PASS {'multi_turn':20s} exact" in out
    assert main(["check-template", str(tmp_path), "--on-mismatch", "split"]) == 0
    assert f"PASS {'reasoning':20s} split" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- (a) ChatML, native tools


def test_chatml_native_tools_is_exact(chatml_tools):
    assert results(check_template(chatml_tools)) == dict.fromkeys(NAMES, "exact")


def test_chatml_grouped_tool_results_are_tool_tokens(chatml_tools):
    t = chatml_tools
    messages, tools = SYNTHETIC["parallel_calls"]
    report, traj = check_conversation(t, messages, tools)
    assert report.result == "exact"
    seg = traj.segment
    first = traj.turns[0]
    tool_text = t.decode([i for i, s in zip(seg.token_ids[first.end:traj.turns[1].start],
                                            seg.sources[first.end:traj.turns[1].start]) if s == Source.TOOL])
    # Both results arrive in one block the template builds; all of it counts as tool output.
    assert tool_text == ('<|im_start|>user\n<tool_response>\n{"temp_c": -3}\n</tool_response>\n'
                         '<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>\n')
    assert "get_weather" in t.decode([i for i, s in zip(seg.token_ids, seg.sources) if s == Source.PROMPT])
    assert traj.messages == messages              # native tools: nothing injected


# ------------------------------------------------------------------------------------------- (b) Llama-3 headers


@pytest.mark.parametrize("name", NAMES)
def test_llama3_differs_only_where_the_generation_prompt_ends(llama3, name):
    # SmolLM2's pre-tokenizer makes a trailing "\n\n" one token but splits "\n\nHello" into "\n", "\n", "Hello".
    # The prompt the policy saw ends in the single token; a full render has two. The text is identical.
    t = llama3
    messages, tools = SYNTHETIC[name]
    report, traj = check_conversation(t, messages, tools, name=name)
    assert report.result == "token_drift", report.detail
    assert t.decode(traj.segment.token_ids) == t.render(traj.messages)
    prompt_ids = t.encode(t.generation_prompt)
    split = t.encode(t.generation_prompt + "x")[:-1]
    assert prompt_ids[-1] == t.encode("\n\n")[0] and split[-2:] == t.encode("\n") * 2
    assert traj.segment.token_ids == replace_run(t.encode(t.render(traj.messages)), split, prompt_ids)
    assert traj.segment.token_ids[:1] == t.encode("<|begin_of_text|>")
    traj.check()


def test_llama3_check_template_passes(llama3):
    assert results(check_template(llama3)) == dict.fromkeys(NAMES, "token_drift")


def test_llama3_tools_are_injected_and_tool_role_rendered(llama3):
    messages, tools = SYNTHETIC["tool_call"]
    report, traj = check_conversation(llama3, messages, tools)
    assert report.result == "token_drift"
    assert traj.messages[0]["role"] == "system" and "get_weather" in traj.messages[0]["content"]
    tool_ids = [i for i, s in zip(traj.segment.token_ids, traj.segment.sources) if s == Source.TOOL]
    assert llama3.decode(tool_ids) == ('<|start_header_id|>tool<|end_header_id|>\n\n'
                                       '{"temp_c": 18, "sky": "clear"}<|eot_id|>')


# ------------------------------------------------------------------------------------------- (c) stripped thinking


def test_strip_thinking_is_detected_as_mismatch(strip_thinking):
    reports = check_template(strip_thinking, on_mismatch="error")
    assert results(reports) == {**dict.fromkeys(NAMES, "exact"), "reasoning": "mismatch"}
    detail = next(r.detail for r in reports if r.name == "reasoning")
    assert "not append-only at turn 0" in detail and "past turns change" in detail


def test_strip_thinking_split_starts_a_fresh_sample(strip_thinking):
    t = strip_thinking
    assert results(check_template(t, on_mismatch="split")) == {**dict.fromkeys(NAMES, "exact"), "reasoning": "split"}
    messages, _ = SYNTHETIC["reasoning"]
    report, traj = check_conversation(t, messages, [], on_mismatch="split")
    assert report.result == "split" and len(traj.segments) == 2
    fresh = t.encode(t.render(messages[:3], add_generation_prompt=True))   # the history, re-rendered
    assert traj.segments[1].token_ids[:len(fresh)] == fresh
    assert set(traj.segments[1].sources[:len(fresh)]) == {Source.PROMPT}
    assert traj.segments[1].token_ids == t.encode(t.render(messages))  # fresh render + the last turn, exactly
    assert traj.segments[0].token_ids == t.encode(t.render(messages[:2]))[:-1]  # up to the first <|im_end|>
    assert [turn.segment for turn in traj.turns] == [0, 1]
    assert traj.metrics["chat_mismatches"] == 1
    traj.check()


def test_strip_thinking_warn_completes_and_counts(strip_thinking):
    t = strip_thinking
    assert results(check_template(t, on_mismatch="warn")) == {**dict.fromkeys(NAMES, "exact"),
                                                              "reasoning": "mismatch"}
    messages, _ = SYNTHETIC["reasoning"]
    report, traj = check_conversation(t, messages, [], on_mismatch="warn")
    assert report.result == "mismatch" and traj.parity == "mismatch"
    assert traj.metrics["chat_mismatches"] == 1
    assert len(traj.segments) == 1 and len(traj.turns) == 2
    # The ledger keeps what the policy saw: its first turn's reasoning, which a re-render strips.
    text = t.decode(traj.segment.token_ids)
    assert text == (t.render(messages[:2]) + "<|im_start|>user\nAnd 6 * 8?<|im_end|>\n<|im_start|>assistant\n"
                    + messages[3]["content"] + "<|im_end|>\n")
    assert "<think>\n6 * 7 = 42\n</think>" in text and "<think>\n6 * 7 = 42" not in t.render(messages)
    assert "first difference at token" in report.detail
    traj.check()


# ------------------------------------------------------------------------------------------- token_diff


def test_token_diff_points_at_the_first_difference(smol_template):
    expected = smol_template.encode("Hello world, again")
    actual = expected[:2] + smol_template.encode(" there")
    text = token_diff(smol_template, expected, actual, context=1)
    assert text.splitlines()[0] == f"first difference at token 2 (expected {len(expected)} tokens, ledger 3)"
    assert "render:" in text and "ledger:" in text and "' there'" in text.splitlines()[2]
