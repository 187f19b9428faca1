"""Answer extraction, reward functions (built-in, verl-signature, dict, async) and their totals."""

import asyncio
import math
import textwrap
from fractions import Fraction

import pytest

from turnrl.config.loader import ConfigError
from turnrl.ledger import ToolResult, Trajectory, Turn
from turnrl.rewards.answers import as_number, extract_answer, same_number
from turnrl.rewards.functions import load_reward_function, score_all, score_trajectory


@pytest.mark.parametrize("text, strict, expected", [
    ("so the total is 12\n#### 72", True, "72"),
    ("#### 1,234", True, "1234"),
    ("#### -15", True, "-15"),
    ("#### $1,050.50", True, "1050.50"),
    ("#### 3/4", True, "3/4"),
    ("first #### 5 then #### 6", True, "6"),              # the last one counts
    (r"The answer is \boxed{42}.", True, "42"),
    (r"\boxed{\frac{3}{4}}", True, "3/4"),
    (r"\boxed{-\dfrac{1}{2}}", True, "-1/2"),
    (r"\boxed{1,000}", True, "1000"),
    ("I get 5, then 7.", True, None),                     # strict: only #### and \boxed
    ("I get 5, then 7.", False, "7"),
    ("The loss is -3.5 dollars", False, "-3.5"),
    ("about 2,500,000 people", False, "2500000"),
    ("a share of 3/8", False, "3/8"),
    ("no digits at all", False, None),
    (".5 of it", False, ".5"),
])
def test_extract_answer(text, strict, expected):
    assert extract_answer(text, strict=strict) == expected


def test_as_number_and_same_number():
    assert as_number("3/4") == Fraction(3, 4)
    assert as_number("1,250.") == 1250
    assert as_number("1e3") == 1000
    assert as_number("x") is None and as_number(None) is None and as_number("1/0") is None
    assert same_number("72", 72) and same_number("0.5", "1/2") and same_number(1250.0, "1,250")
    assert not same_number("72", "73") and not same_number(None, "1") and not same_number("abc", "abc")


def trajectory(answer, ground_truth="72", data_source="gsm8k", **info):
    return Trajectory(group_id="g", sample_index=0,
                      messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}],
                      info={"ground_truth": ground_truth, "data_source": data_source, "index": 3,
                            "extra": {"split": "test"}, **info})


def score(traj, names, **flags):
    asyncio.run(score_trajectory(traj, [load_reward_function(n) for n in names], **flags))
    return traj


def test_builtin_reward_functions():
    traj = score(trajectory("Work...\n#### 72"), ["exact_answer", "last_number", "answer_format", "tool_success"])
    assert traj.reward_parts == {"exact_answer": 1.0, "last_number": 1.0, "answer_format": 1.0, "tool_success": 0.0}
    assert traj.reward == 3.0
    lenient = score(trajectory("it is 72"), ["exact_answer", "last_number", "answer_format"])
    assert lenient.reward_parts == {"exact_answer": 0.0, "last_number": 1.0, "answer_format": 0.0}


def test_tool_success_needs_a_call_without_error():
    traj = trajectory("#### 1")
    traj.turns = [Turn(0, 0, 0, 0, "stop", "", tool_results=[ToolResult("calc", "Error", error="boom")])]
    assert score(traj, ["tool_success"]).reward == 0.0
    traj.turns[0].tool_results.append(ToolResult("calc", "5"))
    assert score(traj, ["tool_success"]).reward_parts["tool_success"] == 1.0


def write(tmp_path, source):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(source))
    return path


def test_verl_signature_function_gets_verls_arguments(tmp_path):
    path = write(tmp_path, '''
        seen = []
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            seen.append((data_source, solution_str, ground_truth, extra_info))
            return 1.0 if solution_str.strip().endswith(ground_truth) else 0.0

        def narrow(solution_str, ground_truth):   # takes only some of verl's arguments
            return float(len(solution_str))
    ''')
    fn = load_reward_function(f"{path}:compute_score", weight=2.0)
    assert fn.verl_style
    traj = trajectory("The answer is 72")
    asyncio.run(score_trajectory(traj, [fn, load_reward_function(f"{path}:narrow")]))
    from turnrl.env.loading import import_object
    seen = import_object(f"{path}:seen")
    assert seen == [("gsm8k", "The answer is 72", "72", {"split": "test", "index": 3})]
    assert traj.reward_parts == {f"{path}:compute_score": 1.0, f"{path}:narrow": 16.0}
    assert traj.reward == 2.0 * 1.0 + 16.0


def test_dict_returns_async_functions_and_numpy_scores(tmp_path):
    path = write(tmp_path, '''
        import asyncio
        import numpy as np

        def detailed(traj):
            return {"score": 0.5, "acc": True, "length": 12, "note": "ignored text"}

        async def slow(traj):
            await asyncio.sleep(0)
            return 0.25

        def numpy_score(traj):
            return np.float32(0.75)
    ''')
    traj = score(trajectory("x"), [f"{path}:detailed", f"{path}:slow", f"{path}:numpy_score"])
    assert traj.reward_parts == {f"{path}:detailed": 0.5, f"{path}:slow": 0.25, f"{path}:numpy_score": 0.75}
    assert traj.reward == pytest.approx(1.5)
    assert traj.metrics == {f"{path}:detailed/acc": 1.0, f"{path}:detailed/length": 12.0}
    assert not traj.masked and traj.errors == []


@pytest.mark.parametrize("body, message", [
    ("raise KeyError('ground_truth')", "KeyError: 'ground_truth'"),
    ("return 'high'", "must return a number or a dict with 'score', got str"),
    ("return {'acc': 1}", "returned a dict without 'score'"),
    ("return None", "got NoneType"),
    ("return float('nan')", "returned nan"),
])
def test_a_failing_reward_function_is_an_error_that_masks_not_a_zero(tmp_path, body, message):
    path = write(tmp_path, f"def bad(traj):\n    {body}\n\ndef good(traj):\n    return 1.0\n")
    traj = score(trajectory("#### 72"), [f"{path}:bad", f"{path}:good"])
    assert traj.masked and [e.kind for e in traj.errors] == ["reward"]
    assert message in traj.errors[0].message and traj.errors[0].message.startswith(f"{path}:bad: ")
    assert f"{path}:bad" not in traj.reward_parts and traj.reward_parts[f"{path}:good"] == 1.0
    assert traj.reward == 1.0


def test_unknown_reward_names_are_config_errors():
    with pytest.raises(ConfigError, match="unknown reward function 'exact': built-ins are exact_answer"):
        load_reward_function("exact")
    with pytest.raises(ConfigError, match="cannot import module"):
        load_reward_function("no_such_module_zq:score")
    with pytest.raises(ConfigError, match="is not callable"):
        load_reward_function("turnrl.rewards.functions:BUILTIN")


def with_env_rewards():
    traj = trajectory("#### 72")
    traj.reward_parts = {"tool:check_answer": 1.0, "interaction": 0.5}
    traj.turns = [Turn(0, 0, 0, 1, "stop", "", tool_reward=0.1, user_reward=0.0),
                  Turn(1, 0, 1, 2, "stop", "", tool_reward=0.2, user_reward=0.3)]
    return traj


@pytest.mark.parametrize("tools, interaction, total", [
    (True, True, 1.0 + 1.0 + 0.5 + 0.3 + 0.3),
    (True, False, 1.0 + 1.0 + 0.3),
    (False, True, 1.0 + 0.5 + 0.3),
    (False, False, 1.0),
])
def test_score_all_totals_with_tool_and_interaction_flags(tools, interaction, total):
    trajs = [with_env_rewards(), with_env_rewards()]
    asyncio.run(score_all(trajs, [load_reward_function("exact_answer")], tools, interaction))
    for traj in trajs:
        assert traj.reward == pytest.approx(total)
        assert [t.reward for t in traj.turns] == pytest.approx(
            [0.1 * tools, 0.2 * tools + 0.3 * interaction])
        assert traj.reward_parts["step:tool"] == pytest.approx(0.3)
        assert traj.reward_parts["step:interaction"] == pytest.approx(0.3)
        assert not math.isnan(traj.reward) and not traj.masked


@pytest.mark.parametrize("answer, truth, expected", [
    (r"So the total is \boxed{285}.", "285", 1.0),
    (r"The share is \frac{3}{4}", "0.75", 1.0),
    ("#### 1/2", "0.5", 1.0),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("I think 290", "285", 0.0),
    ("no answer here", "285", 0.0),
])
def test_math_equiv_compares_answers_mathematically(answer, truth, expected):
    pytest.importorskip("math_verify")
    assert score(trajectory(answer, ground_truth=truth), ["math_equiv"]).reward_parts["math_equiv"] == expected


def test_math_equiv_says_what_to_install(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(ConfigError, match="needs math-verify: pip install math-verify"):
        load_reward_function("math_equiv")
