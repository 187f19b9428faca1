import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.ledger import (
    ErrorRecord,
    LedgerError,
    Segment,
    Source,
    ToolCall,
    ToolResult,
    Trajectory,
    Turn,
)
from turnrl.train.batching import to_rows as to_batch   # the ledger's trajectories as training rows

ENV_SOURCES = [Source.TOOL, Source.USER, Source.TEMPLATE]
REWARDS = st.floats(-10, 10, allow_nan=False).map(lambda x: round(x, 3))
LOGPROBS = st.floats(-20, 0, allow_nan=False)


# ------------------------------------------------------------------------------------------- strategies


@st.composite
def segment_plans(draw):
    """(prompt length, [(policy logprobs, [(env source, env length), ...]), ...]) for one segment."""
    prompt = draw(st.integers(0, 6))
    turns = draw(st.lists(st.tuples(st.lists(LOGPROBS, max_size=6),
                                    st.lists(st.tuples(st.sampled_from(ENV_SOURCES), st.integers(1, 4)),
                                             max_size=3)), max_size=4))
    return prompt, turns


@st.composite
def trajectories(draw, group_id=None):
    """A trajectory built the way the chat layer builds one: appends only, turn indices never go back."""
    traj = Trajectory(group_id=group_id or draw(st.sampled_from("abc")), sample_index=draw(st.integers(0, 7)),
                      messages=[{"role": "user", "content": draw(st.text(max_size=10))}])
    traj.segments = []
    turn = 0
    for plan_prompt, plan_turns in draw(st.lists(segment_plans(), min_size=1, max_size=3)):
        seg = Segment()
        traj.segments.append(seg)
        seg.append(draw(st.lists(st.integers(3, 999), min_size=plan_prompt, max_size=plan_prompt)),
                   Source.PROMPT, turn)
        for logprobs, env in plan_turns:
            start = len(seg)
            seg.append(draw(st.lists(st.integers(3, 999), min_size=len(logprobs), max_size=len(logprobs))),
                       Source.POLICY, turn, logprobs)
            traj.turns.append(Turn(turn, len(traj.segments) - 1, start, len(seg), "stop", "text",
                                   reward=draw(REWARDS)))
            for source, n in env:
                seg.append(list(range(5, 5 + n)), source, turn)
            turn += 1
    traj.reward = draw(REWARDS)
    if draw(st.booleans()):
        traj.add_error("tool_error", "the tool crashed", turn=0)
    return traj


def last_policy(seg):
    return max((i for i, s in enumerate(seg.sources) if s == Source.POLICY), default=-1)


# ------------------------------------------------------------------------------------------- invariants


@settings(max_examples=150, deadline=None)
@given(trajectories())
def test_built_trajectories_satisfy_invariants(traj):
    traj.check()
    for seg in traj.segments:
        for tok_source, mask, lp in zip(seg.sources, seg.loss_mask, seg.logprobs):
            assert mask == (tok_source == Source.POLICY)
            if tok_source != Source.POLICY:
                assert lp == 0.0
    assert traj.n_tokens() == sum(traj.n_tokens(s) for s in Source)
    assert traj.n_tokens(Source.POLICY) == sum(t.end - t.start for t in traj.turns)


@settings(max_examples=150, deadline=None)
@given(st.lists(trajectories(), min_size=1, max_size=4), st.integers(0, 3))
def test_to_batch_shapes_padding_and_fields(trajs, pad_id):
    b = to_batch(trajs, pad_id=pad_id)
    rows = [(ti, si) for ti, t in enumerate(trajs) for si in range(len(t.segments))]
    width = max(len(trajs[ti].segments[si]) for ti, si in rows)
    for name in ("input_ids", "attention_mask", "position_ids", "loss_mask", "old_logprobs", "token_rewards",
                 "turn_ids"):
        assert getattr(b, name).shape == (len(rows), width), name
    assert b.traj_index.shape == (len(rows),) and torch.equal(b.engine_logprobs, b.old_logprobs)
    assert b.input_ids.dtype == b.position_ids.dtype == b.turn_ids.dtype == torch.long
    assert b.loss_mask.dtype == b.old_logprobs.dtype == torch.float32
    for row, (ti, si) in enumerate(rows):
        traj, seg = trajs[ti], trajs[ti].segments[si]
        n = len(seg)
        assert b.input_ids[row, :n].tolist() == seg.token_ids
        assert (b.input_ids[row, n:] == pad_id).all()
        assert b.attention_mask[row].tolist() == [1] * n + [0] * (width - n)
        assert b.position_ids[row].tolist() == list(range(n)) + [0] * (width - n)
        expected_mask = [0.0] * n if traj.masked else [float(s == Source.POLICY) for s in seg.sources]
        assert b.loss_mask[row].tolist() == expected_mask + [0.0] * (width - n)
        assert b.old_logprobs[row, :n].tolist() == pytest.approx(seg.logprobs)
        assert (b.old_logprobs[row, n:] == 0).all()
        assert b.turn_ids[row, :n].tolist() == seg.turns
        assert b.traj_index[row] == ti


@settings(max_examples=200, deadline=None)
@given(trajectories(group_id="g"), st.booleans())
def test_token_rewards_sum_to_total_on_policy_tokens(traj, turn_rewards):
    b = to_batch([traj], turn_rewards=turn_rewards)
    has_policy = [last_policy(s) >= 0 for s in traj.segments]
    if not any(has_policy):
        assert (b.token_rewards == 0).all()   # nothing the policy wrote to credit
        return
    assert b.token_rewards.sum().item() == pytest.approx(traj.reward, abs=1e-3)
    outcome_row = max(i for i, ok in enumerate(has_policy) if ok)
    expected = torch.zeros_like(b.token_rewards)
    outcome = traj.reward
    if turn_rewards:
        for t in traj.turns:
            if t.end > t.start:
                expected[t.segment, t.end - 1] += t.reward
                outcome -= t.reward
    expected[outcome_row, last_policy(traj.segments[outcome_row])] += outcome
    torch.testing.assert_close(b.token_rewards, expected, atol=1e-4, rtol=0)
    # Rewards only ever sit on policy tokens.
    nonzero = b.token_rewards.nonzero().tolist()
    assert all(traj.segments[r].sources[c] == Source.POLICY for r, c in nonzero)


def test_outcome_reward_survives_a_final_segment_without_policy_tokens():
    # A split whose new segment got no assistant turn (the budget ran out right after the break).
    traj = Trajectory("g", 0, [])
    traj.segments[0].append([1, 2], Source.PROMPT, 0)
    traj.segments[0].append([3, 4], Source.POLICY, 0, [-0.5, -0.25])
    traj.turns.append(Turn(0, 0, 2, 4, "stop", "x", reward=0.5))
    traj.segments.append(Segment())
    traj.segments[1].append([1, 2, 3, 4, 5], Source.PROMPT, 0)
    traj.reward = 2.0
    traj.check()
    b = to_batch([traj])
    assert b.token_rewards.tolist() == [[0, 0, 0, 2.0, 0], [0] * 5]
    b = to_batch([traj], turn_rewards=True)
    assert b.token_rewards.tolist() == [[0, 0, 0, 2.0, 0], [0] * 5]  # 0.5 turn reward + 1.5 outcome


def test_turn_rewards_hand_values():
    traj = Trajectory("g", 0, [])
    seg = traj.segment
    seg.append([1], Source.PROMPT, 0)
    seg.append([10, 11], Source.POLICY, 0, [-1.0, -2.0])
    seg.append([20], Source.TOOL, 0)
    seg.append([21], Source.TEMPLATE, 0)
    seg.append([12], Source.POLICY, 1, [-3.0])
    traj.turns = [Turn(0, 0, 1, 3, "stop", "a", reward=0.25), Turn(1, 0, 5, 6, "stop", "b", reward=0.5)]
    traj.reward = 2.0
    traj.check()
    assert to_batch([traj]).token_rewards.tolist() == [[0, 0, 0, 0, 0, 2.0]]
    b = to_batch([traj], turn_rewards=True)
    assert b.token_rewards.tolist() == [[0, 0, 0.25, 0, 0, 1.75]]  # turn 1's 0.5 + outcome 1.25 on the last
    assert b.loss_mask.tolist() == [[0, 1, 1, 0, 0, 1]]
    assert b.old_logprobs.tolist() == [[0, -1, -2, 0, 0, -3]]
    assert b.turn_ids.tolist() == [[0, 0, 0, 0, 0, 1]]


@settings(max_examples=100, deadline=None)
@given(trajectories())
def test_masked_trajectories_have_zero_loss_mask(traj):
    traj.mask("environment failure")
    traj.check()                                    # policy tokens outside the mask are fine once masked
    b = to_batch([traj])
    assert (b.loss_mask == 0).all()
    assert b.attention_mask.sum().item() == traj.n_tokens()   # the rows stay


def test_empty_batch_and_empty_segment():
    b = to_batch([Trajectory("g", 0, [])])
    assert b.input_ids.shape == (1, 0) and b.traj_index.tolist() == [0]
    assert to_batch([]).input_ids.shape == (0, 0)


# ------------------------------------------------------------------------------------------- JSON


@settings(max_examples=100, deadline=None)
@given(trajectories(), st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=5),
                                                                       st.lists(st.floats(-1, 1)))))
def test_json_round_trip_is_lossless(traj, metrics):
    traj.metrics = metrics
    traj.tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    traj.reward_parts = {"accuracy": 1.0, "tool:calc": -0.5}
    traj.info = {"ground_truth": "42", "index": 3}
    traj.timings = {"total_s": 0.25}
    traj.parity, traj.termination, traj.policy_version = "exact", "eos", 7
    if traj.turns:
        traj.turns[0].tool_calls = [ToolCall("calc", {"x": [1, 2]}, "<tool_call>..</tool_call>", "call_0"),
                                    ToolCall("", None, "<tool_call>{", "call_1", error="malformed JSON")]
        traj.turns[0].tool_results = [ToolResult("calc", "3", "call_0", reward=1.0, metrics={"ms": 2},
                                                 blame=None, truncated=True, seconds=0.5)]
        traj.turns[0].user_reply = "ok"
        traj.turns[0].versions = [(0, 6), (3, 7)]
    traj.errors.append(ErrorRecord("tool_parse", "bad call", 0, "policy"))
    plain = traj.to_dict()
    assert plain == dataclasses.asdict(traj)       # the fast copy is asdict's result ...
    plain["segments"][0]["token_ids"].append(-1)   # ... and shares no container with the trajectory
    plain["info"]["index"] = -1
    assert traj.to_dict() == dataclasses.asdict(traj) != plain
    text = json.dumps(traj.to_dict())
    back = Trajectory.from_dict(json.loads(text))
    assert back == traj
    assert json.dumps(back.to_dict()) == text
    back.check()


# ------------------------------------------------------------------------------------------- check() catches


def good_trajectory():
    traj = Trajectory("g", 0, [])
    seg = traj.segment
    seg.append([1, 2], Source.PROMPT, 0)
    seg.append([10, 11], Source.POLICY, 0, [-0.5, -0.5])
    seg.append([20], Source.TOOL, 0)
    seg.append([30], Source.USER, 1)
    traj.turns.append(Turn(0, 0, 2, 4, "stop", "x"))
    traj.check()
    return traj


@pytest.mark.parametrize("breakage, message", [
    (lambda t: t.segment.loss_mask.__setitem__(4, 1), "token 4: loss mask on a non-policy token"),
    (lambda t: t.segment.logprobs.__setitem__(0, -1.0), "token 0: logprob on a non-policy token"),
    (lambda t: t.segment.logprobs.append(0.0), "per-token lists differ in length"),
    (lambda t: t.segment.sources.pop(), "per-token lists differ in length"),
    (lambda t: t.segment.token_ids.append(5), "per-token lists differ in length"),
    (lambda t: t.segment.loss_mask.__setitem__(2, 0), "token 2: policy token outside the loss mask"),
    (lambda t: t.segment.turns.__setitem__(4, 2), "turn indices go backwards"),
    (lambda t: setattr(t.turns[0], "end", 9), "turn 0: span out of range"),
    (lambda t: setattr(t.turns[0], "start", 1), "turn 0: span holds non-policy tokens"),
])
def test_check_catches_broken_invariants(breakage, message):
    traj = good_trajectory()
    breakage(traj)
    with pytest.raises(LedgerError, match=message):
        traj.check()


def test_segment_append_rejects_inconsistent_logprobs():
    seg = Segment()
    with pytest.raises(LedgerError, match="policy tokens need one logprob each"):
        seg.append([1, 2], Source.POLICY, 0, [-1.0])
    with pytest.raises(LedgerError, match="policy tokens need one logprob each"):
        seg.append([1], Source.POLICY, 0)
    with pytest.raises(LedgerError, match="only policy tokens carry logprobs"):
        seg.append([1], Source.TOOL, 0, [-1.0])
    assert len(seg) == 0


def test_errors_mask_by_blame():
    traj = good_trajectory()
    traj.add_error("tool_parse", "bad JSON", turn=0, blame="policy")
    assert not traj.masked                    # the policy's own mistake stays in the loss
    traj.add_error("tool_timeout", "slow", turn=0)
    traj.add_error("interaction", "down")
    assert traj.masked and traj.mask_reason == "tool_timeout: slow"   # the first reason is kept
    assert [e.kind for e in traj.errors] == ["tool_parse", "tool_timeout", "interaction"]
    assert to_batch([traj]).loss_mask.sum().item() == 0


# ---------------------------------------------------------------------- closed vocabularies (issue 16 item 4)


@pytest.mark.parametrize("build", [
    lambda: Trajectory("g", 0, [], termination="eso"),
    lambda: Trajectory("g", 0, [], parity="exactly"),
    lambda: ErrorRecord("tool_eror", "m"),
    lambda: ErrorRecord("tool_error", "m", 0, "enviroment"),
    lambda: ToolResult("calc", "x", blame="polcy"),
])
def test_a_typo_in_a_closed_vocabulary_fails_at_construction(build):
    with pytest.raises(ValueError, match="one of"):
        build()


def test_a_typo_fails_on_assignment_and_through_add_error():
    traj = Trajectory("g", 0, [])
    with pytest.raises(ValueError, match="one of"):
        traj.termination = "context-limit"
    with pytest.raises(ValueError, match="one of"):
        traj.add_error("tool_timout", "slow")
    traj.termination = "context_limit"
    traj.add_error("tool_timeout", "slow")
    assert traj.termination == "context_limit" and traj.errors[0].kind == "tool_timeout"


def test_vocabularies_survive_json_round_trips():
    traj = Trajectory("g", 0, [], termination="eos", parity="exact")
    traj.add_error("tool_parse", "bad JSON", turn=0, blame="policy")
    text = json.dumps(traj.to_dict())
    assert '"termination": "eos"' in text and '"blame": "policy"' in text
    back = Trajectory.from_dict(json.loads(text))
    assert back.termination == "eos" and back.errors[0].kind == "tool_parse" and back.parity == "exact"
