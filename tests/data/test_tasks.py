"""Built-in generated tasks: deterministic by seed, answers that match their questions, checked options."""

import re

import pytest

from turnrl.data import DataError, TASKS, generate_task, load_dataset
from turnrl.env.builtin.calculator import evaluate


@pytest.mark.parametrize("name", sorted(TASKS))
def test_same_seed_same_tasks_other_seed_other_tasks(name):
    a = generate_task(name, 6, seed=3, options={})
    b = generate_task(name, 6, seed=3, options={})
    c = generate_task(name, 6, seed=4, options={})
    def content(tasks):
        return [(t.messages, t.ground_truth, t.interaction) for t in tasks]
    assert content(a) == content(b)
    assert content(a) != content(c)
    assert len({t.uid for t in a}) == 6 and all(t.data_source == name for t in a)
    assert [t.index for t in a] == list(range(6))


def test_calculator_ground_truth_is_the_value_of_the_expression():
    for task in generate_task("calculator", 50, seed=0, options={"steps": 3, "max_value": 40}):
        expr = task.extra["expression"]
        assert evaluate(expr) == int(task.ground_truth), expr
        assert task.tools == ["calculator"] and f"What is {expr}?" in task.messages[-1]["content"]


def test_calculator_demo_is_a_worked_example_of_another_expression():
    plain = generate_task("calculator", 2, seed=1, options={})
    demo = generate_task("calculator", 2, seed=1, options={"demo": True})
    assert [m["role"] for m in plain[0].messages] == ["system", "user"]
    roles = [m["role"] for m in demo[0].messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]
    call, result, answer = demo[0].messages[2]["content"], demo[0].messages[3]["content"], demo[0].messages[4]["content"]
    example = re.search(r'"expression": "([^"]+)"', call).group(1)
    assert call.startswith("<tool_call>\n") and call.endswith("\n</tool_call>")
    assert evaluate(example) == int(result) and answer.endswith(f"#### {result}")
    assert example != demo[0].extra["expression"]
    assert demo[0].messages[-1] == plain[0].messages[-1]        # the question itself is unchanged


def test_feedback_math_rows_carry_the_interaction_and_its_options():
    tasks = generate_task("feedback_math", 20, seed=0, options={"max_attempts": 2, "max_value": 9})
    for task in tasks:
        expr = task.extra["expression"]
        assert evaluate(expr) == int(task.ground_truth)
        assert task.tools == [] and task.interaction == {"name": "math_feedback", "ground_truth": task.ground_truth,
                                                          "max_attempts": 2}


def test_guess_number_secret_in_range():
    tasks = generate_task("guess_number", 30, seed=0, options={"low": 5, "high": 9})
    secrets = {t.interaction["secret"] for t in tasks}
    assert secrets <= set(range(5, 10)) and len(secrets) > 1
    assert all(str(t.interaction["secret"]) == t.ground_truth for t in tasks)
    assert "between 5 and 9" in tasks[0].messages[-1]["content"]


def test_options_and_names_are_checked():
    with pytest.raises(DataError, match=r"task 'calculator': unknown option\(s\) \['stepz'\]; valid: \['demo', "):
        generate_task("calculator", 2, 0, {"stepz": 3})
    with pytest.raises(DataError, match="unknown built-in task 'sudoku'; built-ins: calculator, feedback_math"):
        load_dataset(task="sudoku")
    assert len(load_dataset(task="guess_number", size=10, max_rows=3)) == 3


@pytest.mark.parametrize("name, options, message", [
    ("calculator", {"steps": "2"}, "option 'steps' must be int, got '2'"),
    ("calculator", {"demo": 1}, "option 'demo' must be bool, got 1"),
    ("calculator", {"max_value": 1}, "option 'max_value' must be at least 2, got 1"),
    ("feedback_math", {"max_attempts": 0}, "option 'max_attempts' must be at least 1"),
    ("guess_number", {"low": 10, "high": 5}, "option 'low' (10) is above 'high' (5)"),
])
def test_option_values_are_checked(name, options, message):
    with pytest.raises(DataError) as err:
        generate_task(name, 2, 0, options)
    assert f"task '{name}': {message}" in str(err.value)
