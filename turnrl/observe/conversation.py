"""A trajectory's conversation split by turn: the prompt's messages, then what each policy turn added.

`Trajectory.messages` holds the whole conversation; every policy turn appended one assistant message and
then the tool results or the simulated user's reply that answered it. So the last `len(turns)` assistant
messages are the policy's, and everything before the first of them is the prompt (a worked example in the
prompt is an assistant message too, which is why we count from the end).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from turnrl.ledger import Trajectory


def split_messages(traj: Trajectory) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """(prompt messages, per turn: [its assistant message, then the messages that answered it])."""
    messages = traj.messages
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not traj.turns or len(assistant) < len(traj.turns):
        return list(messages), [[] for _ in traj.turns]
    starts = assistant[len(assistant) - len(traj.turns):]
    ends = starts[1:] + [len(messages)]
    return list(messages[:starts[0]]), [list(messages[a:b]) for a, b in zip(starts, ends)]


def prompt_text(traj: Trajectory) -> str:
    """The prompt's last user message (the question), or its last message of any role."""
    prompt, _ = split_messages(traj)
    users = [m for m in prompt if m.get("role") == "user"]
    last = users[-1] if users else (prompt[-1] if prompt else {})
    return str(last.get("content") or "")


def final_answer(traj: Trajectory) -> str:
    """What the policy said last."""
    return traj.turns[-1].text if traj.turns else ""
