import pytest

from turnrl.chat.parity import WEATHER
from turnrl.chat.session import ChatMismatchError, ChatSession
from turnrl.ledger import Source, Trajectory

IM_END, NL = 2, 198


def new_session(template, messages, tools=(), on_mismatch="error"):
    traj = Trajectory("g", 0, [])
    return ChatSession(template, messages, list(tools), traj, on_mismatch), traj


def policy(session, text, turn, stop=True):
    """Append `text` as if the policy sampled its canonical tokens: with the stop token, or cut by length."""
    t = session.template
    ids = t.encode(text) + ([t.stop_token_ids[0]] if stop else [])
    logprobs = [-0.1 * (k + 1) for k in range(len(ids))]
    return session.add_assistant(ids, logprobs, "stop" if stop else "length", turn), ids, logprobs


def tokens_by_source(template, seg, start, source):
    return template.decode([t for t, s in zip(seg.token_ids[start:], seg.sources[start:]) if s == source])


# ------------------------------------------------------------------------------------------- glue tokens


def test_prompt_is_the_rendered_conversation_with_generation_prompt(smol_template):
    session, traj = new_session(smol_template, [{"role": "user", "content": "Hi"}])
    text = smol_template.render(traj.messages, add_generation_prompt=True)
    assert traj.segment.token_ids == smol_template.encode(text)
    assert set(traj.segment.sources) == {Source.PROMPT}
    assert session.context_ids is traj.segment.token_ids


def test_newline_after_im_end_is_a_template_token(smol_template):
    session, traj = new_session(smol_template, [{"role": "user", "content": "Hi"}])
    turn, ids, logprobs = policy(session, "Hello! How can I help?", 0)
    assert ids[-1] == IM_END
    seg = traj.segment
    assert seg.token_ids[turn.start:turn.end] == ids and seg.logprobs[turn.start:turn.end] == logprobs
    assert turn.text == "Hello! How can I help?"        # the stop token is not part of the message
    assert traj.messages[-1] == {"role": "assistant", "content": "Hello! How can I help?"}
    added = session.add_environment([{"role": "user", "content": "Add 2 and 3."}], 0)
    after = turn.end
    assert len(seg) - after == added
    assert seg.token_ids[after] == NL and seg.sources[after] == Source.TEMPLATE   # the glue the policy skipped
    assert tokens_by_source(smol_template, seg, after, Source.USER) == "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n"
    assert tokens_by_source(smol_template, seg, after, Source.TEMPLATE) == "\n<|im_start|>assistant\n"
    n_user = seg.sources.count(Source.USER)
    assert seg.sources[after:] == [Source.TEMPLATE] + [Source.USER] * n_user + [Source.TEMPLATE] * (added - 1 - n_user)
    assert smol_template.decode(seg.token_ids) == smol_template.render(traj.messages, add_generation_prompt=True)
    traj.check()


def test_length_truncated_turn_is_closed_by_template_tokens(smol_template):
    session, traj = new_session(smol_template, [{"role": "user", "content": "Count to ten."}])
    turn, ids, _ = policy(session, "One, two, three, fo", 0, stop=False)
    assert turn.finish_reason == "length" and turn.text == "One, two, three, fo"
    session.add_environment([{"role": "user", "content": "Go on."}], 0)
    seg = traj.segment
    assert seg.token_ids[turn.end:turn.end + 2] == [IM_END, NL]
    assert seg.sources[turn.end:turn.end + 2] == [Source.TEMPLATE, Source.TEMPLATE]
    assert seg.loss_mask[turn.end:turn.end + 2] == [0, 0]      # <|im_end|> the policy never wrote is not trained
    turn2, _, _ = policy(session, "four, fi", 1, stop=False)
    assert session.finish() == "exact"
    assert seg.token_ids[turn2.end:] == [IM_END, NL] and seg.sources[turn2.end:] == [Source.TEMPLATE] * 2
    traj.check()


def test_turn_cut_inside_a_character_keeps_its_tokens(smol_template):
    t = smol_template
    session, traj = new_session(t, [{"role": "user", "content": "Draw a cat."}])
    cut = t.encode("A cat 🐈")[:-1]                   # the emoji's last byte was never sampled
    turn = session.add_assistant(cut, [-1.0] * len(cut), "length", 0)
    assert turn.text == "A cat \ufffd"
    session.add_environment([{"role": "user", "content": "More."}], 0)   # no mismatch: the text agrees
    policy(session, "Meow.", 1)
    assert session.finish() == "token_drift"
    assert traj.segment.token_ids[turn.start:turn.end] == cut
    assert traj.segment.token_ids[turn.end:turn.end + 2] == [IM_END, NL]


def test_stop_on_eos_finish_adds_closing_newline(smol_template):
    session, traj = new_session(smol_template, [{"role": "user", "content": "Hi"}])
    turn, _, _ = policy(session, "Hello.", 0)
    assert session.finish() == "exact"
    assert traj.segment.token_ids[turn.end:] == [NL]
    assert traj.segment.sources[turn.end:] == [Source.TEMPLATE]
    assert session.finish() == "exact" and traj.segment.token_ids[turn.end:] == [NL]   # idempotent


# ------------------------------------------------------------------------------------------- tools and sources


def test_multi_turn_tool_conversation_matches_a_full_render(smol_template):
    t = smol_template
    session, traj = new_session(t, [{"role": "system", "content": "Use tools."},
                                    {"role": "user", "content": "Weather in Oslo and Lima?"}], [WEATHER])
    assert traj.tools == [WEATHER]
    system = traj.messages[0]["content"]
    assert system.startswith("Use tools.\n\n# Tools") and '"name": "get_weather"' in system
    calls = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>')
    t0, _, _ = policy(session, calls, 0)
    start = len(traj.segment)
    session.add_environment([t.tool_message("get_weather", '{"temp_c": -3}', "call_0"),
                             t.tool_message("get_weather", '{"temp_c": 21}', "call_1")], 0)
    seg = traj.segment
    assert tokens_by_source(t, seg, start, Source.TOOL) == (
        '<|im_start|>tool\n{"temp_c": -3}<|im_end|>\n<|im_start|>tool\n{"temp_c": 21}<|im_end|>\n')
    t1, _, _ = policy(session, "Oslo: -3 °C. Lima: 21 °C. Anything else?", 1)
    start = len(seg)
    session.add_environment([{"role": "user", "content": "No, thanks!"}], 1)
    assert tokens_by_source(t, seg, start, Source.USER) == "<|im_start|>user\nNo, thanks!<|im_end|>\n"
    assert tokens_by_source(t, seg, start, Source.TOOL) == ""
    t2, _, _ = policy(session, "Bye!", 2)
    assert session.finish() == "exact" and traj.parity == "exact"
    assert seg.token_ids == t.encode(t.render(traj.messages))    # the ledger is a full re-render, token for token
    assert [turn.index for turn in traj.turns] == [0, 1, 2]
    policy_ids = [i for i, s in enumerate(seg.sources) if s == Source.POLICY]
    assert policy_ids == [*range(t0.start, t0.end), *range(t1.start, t1.end), *range(t2.start, t2.end)]
    assert set(seg.sources) == {Source.PROMPT, Source.POLICY, Source.TOOL, Source.USER, Source.TEMPLATE}
    traj.check()


def test_policy_tokens_are_never_retokenized(smol_template):
    t = smol_template
    session, traj = new_session(t, [{"role": "user", "content": "Capital of France?"}])
    canonical = t.encode("It is Paris.")
    letters = [t.tokenizer.convert_tokens_to_ids(c) for c in "aris"]   # " Paris" spelled out letter by letter
    spelled = t.encode("It is") + t.encode(" P") + letters + t.encode(".")
    assert t.decode(spelled) == "It is Paris." and spelled != canonical and len(spelled) > len(canonical)
    ids = spelled + [IM_END]
    turn = session.add_assistant(ids, [-0.5] * len(ids), "stop", 0)
    session.add_environment([{"role": "user", "content": "And of Spain?"}], 0)
    policy(session, "Madrid.", 1)
    assert traj.segment.token_ids[turn.start:turn.end] == ids   # exactly what was sampled
    assert traj.messages[-3]["content"] == "It is Paris."
    assert session.finish() == "token_drift"                    # same text, other tokens: not a mismatch
    assert traj.parity == "token_drift"
    assert t.decode(traj.segment.token_ids) == t.render(traj.messages)
    traj.check()


# ------------------------------------------------------------------------------------------- mismatches


THOUGHT = "<think>\nEasy: 6 * 7 = 42.\n</think>\n\n42"
USER2 = {"role": "user", "content": "And 6 * 8?"}


def thought_then_question(template, on_mismatch):
    """A turn with reasoning, then a new user message: the template now strips that reasoning."""
    session, traj = new_session(template, [{"role": "user", "content": "6 * 7?"}], on_mismatch=on_mismatch)
    first, _, _ = policy(session, THOUGHT, 0)
    return session, traj, first


def test_stripped_reasoning_is_an_error_by_default(strip_thinking):
    session, traj, _ = thought_then_question(strip_thinking, "error")
    with pytest.raises(ChatMismatchError, match="not append-only at turn 0.*past turns change.*on_mismatch"):
        session.add_environment([USER2], 0)
    assert traj.metrics["chat_mismatches"] == 1


def test_stripped_reasoning_splits_into_a_fresh_sample(strip_thinking):
    t = strip_thinking
    session, traj, first = thought_then_question(t, "split")
    session.add_environment([USER2], 0)
    assert len(traj.segments) == 2 and traj.parity == "split"
    history = [{"role": "user", "content": "6 * 7?"}, {"role": "assistant", "content": THOUGHT}, USER2]
    # the reasoning is kept as reasoning_content; rendered, it joins back to what was sampled
    assert traj.messages[1] == {"role": "assistant", "content": "\n\n42", "reasoning_content": "\nEasy: 6 * 7 = 42.\n"}
    assert [t.join_reasoning(m) for m in traj.messages] == history
    assert traj.segments[1].token_ids == t.encode(t.render(history, add_generation_prompt=True))
    assert set(traj.segments[1].sources) == {Source.PROMPT}
    assert "<think>" not in t.decode(traj.segments[1].token_ids)   # the new sample sees the stripped history
    assert traj.segments[0].token_ids[first.start:first.end] == t.encode(THOUGHT) + [IM_END]
    second, _, _ = policy(session, "<think>\n42 + 6\n</think>\n\n48", 1)
    assert second.segment == 1 and first.segment == 0
    assert session.finish() == "exact" and traj.parity == "split"
    traj.check()


def test_stripped_reasoning_with_warn_keeps_what_the_policy_saw(strip_thinking):
    t = strip_thinking
    session, traj, _ = thought_then_question(t, "warn")
    session.add_environment([USER2], 0)
    policy(session, "48", 1)
    assert len(traj.segments) == 1 and traj.metrics["chat_mismatches"] == 1
    assert session.finish() == "mismatch" and traj.parity == "mismatch"
    assert "parity_detail" in traj.metrics
    assert t.decode(traj.segment.token_ids) == (
        "<|im_start|>user\n6 * 7?<|im_end|>\n<|im_start|>assistant\n" + THOUGHT + "<|im_end|>\n"
        "<|im_start|>user\nAnd 6 * 8?<|im_end|>\n<|im_start|>assistant\n48<|im_end|>\n")
    traj.check()


def test_trimmed_template_agrees_when_policy_text_is_trimmed(llama3):
    t = llama3
    session, traj = new_session(t, [{"role": "user", "content": "Hi"}])
    policy(session, "Hello there.", 0)
    start = len(traj.segment)
    session.add_environment([{"role": "user", "content": " Tell me a joke. "}], 0)
    assert tokens_by_source(t, traj.segment, start, Source.USER) == (
        "<|start_header_id|>user<|end_header_id|>\n\nTell me a joke.<|eot_id|>")
    assert tokens_by_source(t, traj.segment, start, Source.TEMPLATE) == (
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    policy(session, "No.", 1)
    assert session.finish() == "token_drift"   # only at the "\n\n" ending each prompt: see test_parity
    assert t.decode(traj.segment.token_ids) == t.render(traj.messages)


def test_untrimmed_policy_text_is_a_mismatch(llama3):
    session, traj = new_session(llama3, [{"role": "user", "content": "Hi"}])
    policy(session, "Hello there.\n", 0)             # the template renders it trimmed: the ledger differs
    with pytest.raises(ChatMismatchError, match="not append-only"):
        session.add_environment([{"role": "user", "content": "Joke?"}], 0)


def test_bad_on_mismatch():
    with pytest.raises(ValueError, match="on_mismatch must be error, warn or split, got 'ignore'"):
        ChatSession(None, [], [], Trajectory("g", 0, []), on_mismatch="ignore")


# ------------------------------------------------------------------------------------------- one render a turn


def _replays(template, monkeypatch, slow):
    """Every synthetic conversation replayed; `slow`: render the history instead of reading it off the render
    with the new messages (the path `add_environment` takes where that shortcut does not apply). Each turn
    the shortcut takes is checked: the ledger then holds the template's own render with the generation prompt."""
    from turnrl.chat.parity import SYNTHETIC, replay_conversation
    real_add, real_history = ChatSession.add_environment, ChatSession._history
    taken = []

    def history(self, full):
        hist = real_history(self, full)
        taken.append(hist is not None)
        return hist

    def add(self, new_messages, turn):
        split = len(self.traj.segments)
        n = real_add(self, new_messages, turn)
        if taken and taken[-1] and len(self.traj.segments) == split:
            assert self._text == self._render(self.traj.messages, generation=True)
            assert self.template.decode(self.context_ids) == self._text
        return n
    monkeypatch.setattr(ChatSession, "_history", (lambda self, full: None) if slow else history)
    monkeypatch.setattr(ChatSession, "add_environment", add)
    out = {}
    for name, (msgs, tools) in SYNTHETIC.items():
        for mode in ("error", "split", "warn"):
            report, traj = replay_conversation(template, msgs, tools, mode, name)
            out[name, mode] = (report.result, [(s.token_ids, s.sources) for s in traj.segments],
                               traj.metrics.get("chat_mismatches"))
    monkeypatch.undo()
    return out, sum(taken)


@pytest.mark.parametrize("fixture", ["smol_template", "chatml_tools", "llama3", "strip_thinking"])
def test_the_history_shortcut_builds_the_same_ledger(fixture, request, monkeypatch):
    """Reading the history off the one render per turn gives the same tokens, sources, results and mismatch
    counts as rendering it, for append-only templates and for ones that are not (stripped reasoning)."""
    template = request.getfixturevalue(fixture)
    (fast, taken), (slow, _) = _replays(template, monkeypatch, slow=False), _replays(template, monkeypatch, slow=True)
    assert fast == slow and taken > 0


def test_the_history_shortcut_in_other_families(smol_tokenizer, monkeypatch):
    """The same in every published family, except where rendering the history finds a break that the next
    prompt does not have: Qwen3 in thinking mode writes an empty thinking block into the latest assistant turn
    only while it is the last message, so the history render differs from what the policy saw, while the
    render with the tool results (the next prompt) continues the ledger exactly. There the shortcut goes on in
    one sample (each prompt checked above) where the history render would have split; the final parity check
    still reports the last turn's block as `mismatch`, as before."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from families import FAMILIES, family_tokenizer
    from turnrl.chat.templates import ChatTemplate
    shortcuts = {}
    for name, family in sorted(FAMILIES.items()):
        template = ChatTemplate(family_tokenizer(smol_tokenizer, family))
        (fast, shortcuts[name]), (slow, _) = _replays(template, monkeypatch, False), _replays(template, monkeypatch, True)
        if name != "qwen3":
            assert fast == slow, name
            continue
        differ = [key for key in fast if fast[key] != slow[key]]
        assert {name for name, _ in differ} == {"multi_turn", "tool_call", "parallel_calls", "empty_and_unicode"}
        for key in differ:
            assert slow[key][2] and fast[key][2] is None, key             # breaks only in the history render
            assert fast[key][0] == slow[key][0] == "mismatch", key        # the final empty block, reported
            assert len(fast[key][1]) == 1 <= len(slow[key][1]), key
    # templates that are append-only here take it (the others fail its check and render the history)
    assert all(shortcuts[name] > 0 for name in ("qwen3", "qwen3_coder", "llama3_2_pythonic", "llama4_pythonic"))


def test_a_tool_result_costs_one_render(smol_template, monkeypatch):
    """The loop measures the turn (`context_after`), then appends it: one render for both; a cut result (other
    messages) renders anew, and the count stays exact."""
    session, traj = new_session(smol_template, [{"role": "user", "content": "Weather?"}], [WEATHER])
    policy(session, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', 0)
    renders = []
    real = ChatSession._render
    monkeypatch.setattr(ChatSession, "_render", lambda self, *a, **k: renders.append(1) or real(self, *a, **k))
    long = [smol_template.tool_message("get_weather", "-3 C and snow " * 20, "c1")]
    cut = [smol_template.tool_message("get_weather", "-3 C", "c1")]
    assert session.context_after(long) > session.context_after(cut)
    expected = session.context_after(cut)
    assert len(renders) == 2                     # long, then cut; asking again renders nothing
    session.add_environment(cut, 0)
    assert len(renders) == 2 and len(traj.segment) == expected
    assert traj.messages[-1]["content"] == "-3 C"
    assert tokens_by_source(smol_template, traj.segment, 0, Source.TOOL).startswith("<|im_start|>")
    assert session.finish() == "exact"
