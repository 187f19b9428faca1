"""Progress: quiet off a terminal (a plain line at most every every_s), nothing with mode off."""

import time

import pytest

from turnrl.observe.progress import Progress, _duration


def test_off_prints_nothing(capsys):
    p = Progress(4, "rollout", "off", every_s=0.0, in_flight=lambda: 2)
    p.update(1, tokens=10)
    p.close()
    assert capsys.readouterr() == ("", "")


def test_plain_lines_off_a_terminal(capsys):
    in_flight = [3]
    p = Progress(4, "rollout 1", "auto", every_s=0.0, in_flight=lambda: in_flight[0])   # pytest's stderr: no TTY
    assert p.bar is None
    time.sleep(0.05)
    p.update(1, tokens=120, reward=0.5)
    in_flight[0] = 1
    p.update(2)
    p.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    last = lines[-1]
    assert last.startswith("[rollout 1] 3/4 trajectories") and "1 turns in flight" in last
    assert "tok/s" in last and "eta " in last and "reward=0.5" in last


def test_lines_wait_every_s(capsys):
    p = Progress(10, "eval", "auto", every_s=30.0)
    for _ in range(5):
        p.update(1)
    assert capsys.readouterr().err == ""             # nothing before every_s has passed ...
    p.close()
    lines = capsys.readouterr().err.splitlines()     # ... and the final count when the batch ends
    assert len(lines) == 1 and lines[0].startswith("[eval] 5/10 trajectories")


def test_the_ticker_reports_between_completions(capsys):
    p = Progress(2, "slow", "auto", every_s=0.05, in_flight=lambda: 2)
    time.sleep(0.3)                                  # no update at all: the ticker still reports
    p.close()
    assert "[slow] 0/2 trajectories" in capsys.readouterr().err


def test_a_broken_counter_is_left_out():
    p = Progress(1, "x", "off", in_flight=lambda: 1 / 0)
    assert p.status() == ""
    p.close()


def test_eta_and_durations():
    p = Progress(10, "x", "off")
    assert p.eta_s() is None
    p.start -= 10.0
    p.update(5)
    assert p.eta_s() == pytest.approx(10.0, rel=0.05)
    assert [_duration(s) for s in (5, 65, 3725)] == ["5s", "1m05s", "1h02m"]


def test_bad_mode():
    with pytest.raises(ValueError, match="auto, on or off"):
        Progress(1, "x", "loud")


def test_the_final_count_is_printed_when_the_batch_ends(capsys):
    """The line must not stop at "2/8" while the last trajectories finish: close() prints the final count."""
    progress = Progress(8, "rollout 3", mode="auto", every_s=3600.0)
    for _ in range(8):
        progress.update(1, tokens=10)
    progress.close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("[rollout 3] 8/8 trajectories"), lines


def test_off_stays_silent_at_the_end(capsys):
    progress = Progress(2, "rollout", mode="off")
    progress.update(2)
    progress.close()
    assert capsys.readouterr().err == ""
