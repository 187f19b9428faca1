"""Property-based fuzzing (hypothesis) of the chat layer, the ledger, tool-call parsing and the config loader.

Random conversations (unicode, empty and huge contents, special-token text, tool results) are replayed
through the real SmolLM2 chat template; random token ids (special tokens included) are fed to a chat session
as if the policy had sampled them. Whatever comes in, only documented errors may come out and the ledger's
invariants hold. Complements the property tests in tests/test_ledger.py, tests/chat/test_parsers.py and
tests/config/test_loader.py.
"""

import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnrl.chat.parity import WEATHER, replay_conversation
from turnrl.chat.parsers import HermesParser
from turnrl.chat.session import ChatMismatchError, ChatSession
from turnrl.config import Config, ConfigError, config_from_dict, dump_yaml
from turnrl.ledger import Source, Trajectory

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SPECIAL = ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<think>", "</think>",
           "<tool_response>", "\n", "\n\n", " ", "\t", "\r\n", "assistant\n", "{", "}", '"', "\\"]
UNICODE = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)       # no lone surrogates
PIECES = st.lists(st.one_of(UNICODE, st.sampled_from(SPECIAL), st.sampled_from(["猫 🐈", "naïve café\u0301", "٣٤"])),
                  max_size=8).map("".join)
CONTENT = st.one_of(st.just(""), PIECES, st.integers(2_000, 20_000).map(lambda n: "word " * n))   # empty, mixed, huge


@st.composite
def conversations(draw):
    """A conversation in an order chat templates accept: optional system, user first, then assistant turns
    each followed by a user message or one or more tool results."""
    tools = draw(st.booleans())
    messages = [{"role": "system", "content": draw(CONTENT)}] if draw(st.booleans()) else []
    messages.append({"role": "user", "content": draw(CONTENT)})
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "assistant", "content": draw(CONTENT)})
        if tools and draw(st.booleans()):
            for _ in range(draw(st.integers(1, 2))):
                messages.append({"role": "tool", "name": "get_weather", "content": draw(CONTENT)})
        elif draw(st.booleans()):
            messages.append({"role": "user", "content": draw(CONTENT)})
        else:
            break
    return messages, [WEATHER] if tools else []


@FUZZ
@given(conversations())
def test_random_conversations_replay_with_parity_and_invariants(smol_template, conversation):
    messages, tools = conversation
    report, traj = replay_conversation(smol_template, messages, tools)
    traj.check()
    assert report.result in ("exact", "token_drift"), report.detail       # ChatML is append-only: never mismatch
    rendered = smol_template.render(traj.messages, None, add_generation_prompt=traj.messages[-1]["role"] != "assistant")
    assert traj.segment.token_ids == smol_template.encode(rendered) or report.result == "token_drift"
    policy = [m["content"] for m in traj.messages if m["role"] == "assistant"]
    assert len(policy) == len(traj.turns)


TOKEN_IDS = st.lists(st.integers(0, 49_151), max_size=30)          # the whole vocabulary, special tokens too


@st.composite
def policy_turns(draw):
    special = draw(st.lists(st.sampled_from([0, 1, 2]), max_size=3))
    ids = draw(TOKEN_IDS) + special
    draw(st.randoms()).shuffle(ids)
    return ids, draw(st.sampled_from(["stop", "length", "abort"]))


@FUZZ
@given(st.lists(st.tuples(policy_turns(), st.sampled_from(["user", "tool"]), PIECES), min_size=1, max_size=3),
       st.sampled_from(["error", "warn", "split"]))
def test_any_sampled_tokens_keep_the_ledger_consistent(smol_template, turns, on_mismatch):
    traj = Trajectory("fuzz", 0, [])
    session = ChatSession(smol_template, [{"role": "user", "content": "Go."}], [WEATHER], traj, on_mismatch)
    try:
        for k, ((ids, finish), role, reply) in enumerate(turns):
            session.add_assistant(ids, [-1.0] * len(ids), finish, k)
            message = smol_template.tool_message("get_weather", reply) if role == "tool" else \
                {"role": "user", "content": reply}
            session.add_environment([message], k)
        session.finish()
    except ChatMismatchError:
        assert on_mismatch == "error"               # the one documented failure, and only when asked for
    traj.check()
    sampled = [t for seg in traj.segments for t, s in zip(seg.token_ids, seg.sources) if s == Source.POLICY]
    if on_mismatch != "split":
        assert sampled == [t for (ids, _), _, _ in turns[:len(traj.turns)] for t in ids]   # never re-tokenized
    assert traj.parity in ("", "exact", "token_drift", "mismatch", "split")


# -- tool calls -------------------------------------------------------------------------------------------------
NAMES = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=20).filter(lambda s: "<" not in s)
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | UNICODE,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(UNICODE, inner, max_size=3),
                           max_leaves=8)
TAGS = ("<tool_call>", "</tool_call>", "<think>", "</think>")


@FUZZ
@given(st.lists(st.tuples(NAMES, st.dictionaries(UNICODE, JSON_VALUES, max_size=4)), max_size=4), PIECES)
def test_written_calls_parse_back_and_calls_in_reasoning_do_not(calls, prose):
    body = [json.dumps({"name": n, "arguments": a}, ensure_ascii=False) for n, a in calls]
    if any(tag in text for text in body + [prose] for tag in TAGS):
        return                                       # text that writes the delimiters itself is ambiguous
    text = prose + "".join(f"<tool_call>\n{b}\n</tool_call>\n" for b in body)
    parsed = HermesParser().parse(text)
    assert [(c.name, c.arguments, c.error) for c in parsed] == [(n, a, None) for n, a in calls]
    assert HermesParser().parse(f"<think>{text}</think>done") == []


# -- config -----------------------------------------------------------------------------------------------------
VALID = st.one_of(
    st.tuples(st.just("rollout.n"), st.integers(1, 64)),
    st.tuples(st.just("model.lora.rank"), st.integers(0, 64)),
    st.tuples(st.just("trainer.optim.lr"), st.floats(1e-8, 1.0)),
    st.tuples(st.just("algo.advantage"), st.sampled_from(["grpo", "drgrpo", "rloo", "reinforce_pp", "gae"])),
    st.tuples(st.just("rollout.truncate_side"), st.sampled_from(["head", "tail", "middle"])),
    st.tuples(st.just("logging.run_name"), UNICODE),
    st.tuples(st.just("logging.wandb_api_key"), UNICODE),
    st.tuples(st.just("data.train.options"), st.dictionaries(st.text("abc", min_size=1, max_size=3), st.integers())),
)


@FUZZ
@given(st.lists(VALID, max_size=6))
def test_valid_overrides_round_trip_through_the_dumped_yaml(pairs):
    overrides = [f"{k}={yaml.safe_dump(v, default_flow_style=True).removesuffix(chr(10) + '...' + chr(10)).strip()}"
                 for k, v in pairs]
    try:
        cfg = config_from_dict({}, overrides)
    except ConfigError:
        return                                       # e.g. a string YAML reads as a number: a documented error
    again = config_from_dict(yaml.safe_load(dump_yaml(cfg, redact=False)))
    assert again == cfg and isinstance(cfg, Config)


@FUZZ
@given(st.text(st.characters(exclude_categories=("Cs",)), min_size=8, max_size=30).map(lambda s: f"sk-{s}-end"),
       st.lists(st.text(max_size=12), max_size=3))
def test_a_secret_never_shows_in_dumps_or_errors(secret, junk):
    quoted = json.dumps(secret, ensure_ascii=False)  # a JSON string is YAML: the secret arrives as it is,
    for c in "\x85\u2028\u2029":                      # except YAML's own line breaks, which fold to a space
        quoted = quoted.replace(c, f"\\u{ord(c):04x}")
    try:
        cfg = config_from_dict({}, [f"logging.wandb_api_key={quoted}", *junk])
    except ConfigError as exc:
        assert secret not in str(exc)
        return
    assert cfg.logging.wandb_api_key == secret
    assert secret not in dump_yaml(cfg) and yaml.safe_load(dump_yaml(cfg))["logging"]["wandb_api_key"] == "***"


@pytest.mark.parametrize("content", ["", "x" * 200_000, "\u0000\ufffd\U0010ffff"])
def test_extreme_single_messages(smol_template, content):
    report, traj = replay_conversation(smol_template, [{"role": "user", "content": content},
                                                       {"role": "assistant", "content": content}], [])
    traj.check()
    assert report.result in ("exact", "token_drift")
