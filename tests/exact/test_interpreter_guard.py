"""The interpreter tests' version guard (tests/conftest.py): which Triton and numpy pairs cannot interpret."""

from tests.conftest import interpreter_blocker


def test_triton_before_3_7_cannot_interpret_with_numpy_2_5():
    reason = interpreter_blocker("3.6.0", "2.5.2")
    assert reason is not None and "Triton 3.6.0" in reason and "numpy 2.5.2" in reason


def test_fixed_triton_or_older_numpy_interprets():
    assert interpreter_blocker("3.7.0", "2.5.2") is None
    assert interpreter_blocker("3.9.0", "2.3.5") is None
    assert interpreter_blocker("3.6.0", "2.4.6") is None
