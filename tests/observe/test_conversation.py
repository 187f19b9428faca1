"""Splitting a trajectory's messages into the prompt and what each turn added."""

from turnrl.ledger import Trajectory, Turn
from turnrl.observe.conversation import final_answer, prompt_text, split_messages


def turn(i, text):
    return Turn(index=i, segment=0, start=0, end=0, finish_reason="stop", text=text)


def test_a_worked_example_in_the_prompt_stays_in_the_prompt():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "demo q"},
                {"role": "assistant", "content": "demo a"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "call"}, {"role": "tool", "content": "42"},
                {"role": "assistant", "content": "#### 42"}]
    traj = Trajectory("g", 0, messages, turns=[turn(0, "call"), turn(1, "#### 42")])
    prompt, per_turn = split_messages(traj)
    assert prompt == messages[:4]
    assert per_turn == [messages[4:6], messages[6:]]
    assert prompt_text(traj) == "q" and final_answer(traj) == "#### 42"


def test_no_turns():
    traj = Trajectory("g", 0, [{"role": "user", "content": "q"}])
    assert split_messages(traj) == ([{"role": "user", "content": "q"}], [])
    assert prompt_text(traj) == "q" and final_answer(traj) == ""
