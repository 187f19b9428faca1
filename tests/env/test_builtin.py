"""Built-in tools and interactions: calculator, check_answer, math_feedback, guess_number."""

from fractions import Fraction

import pytest

from turnrl.env.builtin.calculator import Calculator, evaluate, format_number
from turnrl.env.builtin.checker import AnswerChecker
from turnrl.env.builtin.feedback import MathFeedback
from turnrl.env.builtin.guess import GuessNumberUser


def said(text):
    return [{"role": "user", "content": "question"}, {"role": "assistant", "content": text}]


# -- calculator -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("expression, value", [
    ("(12 + 7) * 3", Fraction(57)),
    ("1/3 + 1/6", Fraction(1, 2)),          # exact rationals, no float rounding
    ("0.1 + 0.2", Fraction(3, 10)),         # decimal literals are exact too
    ("3 // 0.1", Fraction(30)),              # with binary floats this is 29
    ("1.5e2 - 1_000", Fraction(-850)),
    ("2 ^ 10", Fraction(1024)),
    ("-(3 - 10) // 2", Fraction(3)),
    ("17 % 5", Fraction(2)),
    ("6 × 7 ÷ 2", Fraction(21)),
    ("2 ** -2", Fraction(1, 4)),
])
def test_calculator_exact_arithmetic(expression, value):
    assert evaluate(expression) == value


def test_calculator_formats_integers_exactly_and_fractions_as_decimals():
    assert format_number(evaluate("10**30 + 1")) == "1000000000000000000000000000001"
    assert format_number(evaluate("1/3")) == "0.333333"
    assert format_number(evaluate("-7/2")) == "-3.5"


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('echo hi')", "unsupported element Call"),
    ("x + 1", "unsupported element Name"),
    ("(1).real", "unsupported element Attribute"),
    ("[1, 2]", "unsupported element List"),
    ("'a' * 3", "unsupported element Constant"),
    ("True + 1", "unsupported element Constant"),
    ("2 ** 65", "exponents must be integers up to 64"),
    ("2 ** 0.5", "exponents must be integers up to 64"),
    ("9 ** 9 ** 9", "exponents must be integers up to 64"),
    ("((10 ** 64) ** 64) ** 64", "result too large"),     # small exponents, but minutes of big-int work
    ("(2 ** 64) ** 64", "result too large"),
    ("0 ** -1", "division by zero"),
    ("1 / 0", "division by zero"),
    ("1 // (2 - 2)", "division by zero"),
    ("5 % 0", "division by zero"),
    ("1 +", "cannot parse"),
    ("1" * 201, "longer than 200"),
])
def test_calculator_rejects_unsafe_or_invalid_input(expression, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        evaluate(expression)


def test_calculator_tool_counts_calls_and_reports_errors_as_text():
    tool = Calculator()
    tool.create()
    ok = tool.execute({"expression": "(2 + 3) * 4"})
    bad = tool.execute({"expression": "open('x')"})
    assert (ok.text, ok.metrics) == ("20", {"calls": 1})
    assert bad.text.startswith("Error: unsupported element Call") and bad.metrics == {"calls": 2, "invalid": 1}
    tool.create()  # a fresh trajectory starts from zero
    assert tool.execute({"expression": "1"}).metrics == {"calls": 1}


# -- check_answer ---------------------------------------------------------------------------------------
def test_check_answer_state_across_submissions():
    tool = AnswerChecker(max_submissions=3)
    tool.create(ground_truth="1,250")
    assert tool.execute({"answer": 12}).text == "Incorrect."
    assert tool.execute({"answer": 1250.0}).text == "Correct."
    assert tool.execute({"answer": 3}).text == "Incorrect."
    last = tool.execute({"answer": 1250})
    assert last.text == "No submissions left." and last.metrics == {"submissions": 3}
    assert tool.reward() == 1.0          # solved once is solved
    tool.release()
    assert tool.ground_truth is None


def test_check_answer_needs_ground_truth_and_scores_zero_when_never_right():
    with pytest.raises(ValueError, match="ground_truth"):
        AnswerChecker().create()
    tool = AnswerChecker()
    tool.create(ground_truth=7)
    tool.execute({"answer": 8})
    assert tool.reward() == 0.0


# -- math_feedback --------------------------------------------------------------------------------------
def test_math_feedback_right_answer_ends_with_reward_one():
    user = MathFeedback()
    user.start(ground_truth="42")
    reply = user.respond(said("The answer is 42."))
    assert reply.done and reply.text == "Correct, thank you!" and reply.info == {"attempts": 1}
    assert user.finish() == 1.0


def test_math_feedback_asks_again_then_stops_without_partial_credit():
    user = MathFeedback(max_attempts=3)
    user.start(ground_truth=10)
    first = user.respond(said("I think it is 9"))
    second = user.respond(said("no idea"))
    third = user.respond(said("#### 11"))
    assert not first.done and first.text.startswith("9 is not correct")
    assert not second.done and "don't see a number" in second.text
    assert third.done and third.text.startswith("That is still not right")
    assert user.finish() == 0.0


def test_math_feedback_partial_credit_keeps_the_best_attempt():
    user = MathFeedback(max_attempts=5, partial_credit=0.5)
    user.start(ground_truth="10")
    user.respond(said("8"))      # 1 - 2/10 = 0.8 -> 0.4
    user.respond(said("30"))     # 1 - 20/10 < 0 -> 0
    assert user.finish() == pytest.approx(0.4)
    zero = MathFeedback(partial_credit=1.0)
    zero.start(ground_truth="0")
    zero.respond(said("0.25"))   # truth 0: the error is scaled by 1
    assert zero.finish() == pytest.approx(0.75)


def test_math_feedback_row_overrides_max_attempts_and_rejects_bad_truth():
    user = MathFeedback(max_attempts=5)
    user.start(ground_truth="3", max_attempts=1)
    assert user.respond(said("4")).done
    with pytest.raises(ValueError, match="numeric ground_truth"):
        MathFeedback().start(ground_truth="three")


# -- guess_number ---------------------------------------------------------------------------------------
def test_guess_number_higher_lower_and_reward():
    user = GuessNumberUser(step_penalty=0.25)
    user.start(secret=13, low=1, high=20)
    assert user.respond(said("Is it 10?")).text == "Higher."
    assert user.respond(said("Between 1 and 20... 17")).text == "Lower."   # the last number is the guess
    nothing = user.respond(said("hmm"))
    assert nothing.text == "Please guess a whole number between 1 and 20." and not nothing.done
    found = user.respond(said("13"))
    assert found.done and found.info == {"guesses": 3}
    assert user.finish() == pytest.approx(0.5)


def test_guess_number_floor_unfound_and_missing_secret():
    user = GuessNumberUser(step_penalty=0.5)
    user.start(secret="4")
    for guess in ("1", "2", "3", "4"):
        user.respond(said(guess))
    assert user.finish() == 0.1
    lost = GuessNumberUser()
    lost.start(secret=50)
    lost.respond(said("-3"))
    assert lost.finish() == 0.0
    with pytest.raises(ValueError, match="secret"):
        GuessNumberUser().start()
