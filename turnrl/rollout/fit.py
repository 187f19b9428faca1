"""Environment turns that fit: tool results and user replies cut to the room the limits leave.

The policy's turns never overshoot because each request's `max_tokens` is the room left. An environment turn
(tool results, a simulated user's reply) is text someone else wrote, of any length: before it is appended,
`fit_turn` measures what the context would hold afterwards (`ChatSession.context_after`, the exact count) and,
when that passes the room, cuts the longest texts to an equal share of what is left with the tool-output marker
(`truncate_tokens`), measures again, and gives up (None: the loop ends the trajectory with `context_limit` or
`token_budget`) when not even the marker and a few tokens fit. One token of room is kept for the next turn.

`truncate_tokens` never tokenizes more than it can keep: a 10 MB text is cut to its ends (a generous number of
characters per kept token) before the tokenizer sees it, and the marker's count of dropped tokens is then
an estimate from the kept ends' characters per token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from turnrl.chat.session import ChatSession
from turnrl.chat.templates import ChatTemplate

MAX_CHARS_PER_TOKEN = 24   # more than any BPE vocabulary's tokens hold on average over a window
MIN_SHARE = 8              # tokens of a text besides its marker; less and the turn does not fit


def truncate_tokens(template: ChatTemplate, text: str, limit: int, side: str) -> tuple[str, bool]:
    """Cut `text` to about `limit` tokens, the marker that says so included; `side` is the part dropped."""
    if side not in ("head", "tail", "middle"):
        raise ValueError(f"truncate side must be head, tail or middle, got {side!r}")
    window = (max(limit, 0) + 64) * MAX_CHARS_PER_TOKEN
    if len(text) <= 2 * window:
        ids = template.encode(text)
        if len(ids) <= limit:
            return text, False
        head_ids = tail_ids = ids
        total = len(ids)
    else:  # tokenizing megabytes costs seconds and gigabytes: only the ends that can be kept are tokenized
        head_ids = template.encode(text[:window]) if side != "head" else []
        tail_ids = template.encode(text[-window:]) if side != "tail" else []
        seen = len(head_ids) + len(tail_ids)
        total = round(seen * len(text) / (window * (2 if side == "middle" else 1)))
    marker_len = len(template.encode(f"...[{total} tokens truncated]..."))
    keep = max(limit - marker_len, 0)
    marker = f"...[{total - keep} tokens truncated]..."
    if side == "head":  # keep the end
        return marker + (template.decode(tail_ids[-keep:]) if keep else ""), True
    if side == "tail":  # keep the start
        return template.decode(head_ids[:keep]) + marker, True
    half = keep // 2
    return template.decode(head_ids[:half]) + marker + template.decode(tail_ids[len(tail_ids) - (keep - half):]), True


@dataclass
class EnvTurn:
    """An environment turn before it is appended: its texts and how they become chat messages."""
    texts: list[str]
    render: Callable[[list[str]], list[dict[str, Any]]]
    cut: bool = False

    def messages(self) -> list[dict[str, Any]]:
        return self.render(self.texts)


def water_level(lengths: list[int], total: int) -> int:
    """The largest cap c with sum(min(n, c)) <= total: short texts stay whole, long ones share the rest."""
    left, count = total, len(lengths)
    for n in sorted(lengths):
        if n * count > left:
            return max(left // count, 0)
        left -= n
        count -= 1
    return max(lengths, default=0)


def fit_turn(session: ChatSession, turn: EnvTurn, max_context: int, side: str) -> EnvTurn | None:
    """`turn`, its texts cut so that the context stays below `max_context` tokens; None when it cannot fit."""
    if session.context_after(turn.messages()) < max_context:
        return turn
    template = session.template
    lengths = [len(template.encode(t)) if len(t) < 100_000 else len(t) for t in turn.texts]
    for _ in range(4):   # the marker and a cut's merges shift the count by a few tokens: measure again
        over = session.context_after(turn.messages()) - (max_context - 1)
        if over <= 0:
            return turn
        share = water_level(lengths, sum(lengths) - over)
        if share < MIN_SHARE + len(template.encode("...[100000 tokens truncated]...")):
            return None
        cut = [truncate_tokens(template, text, share, side) if n > share else (text, False)
               for text, n in zip(turn.texts, lengths)]
        turn = replace(turn, texts=[c[0] for c in cut], cut=turn.cut or any(c[1] for c in cut))
        lengths = [min(n, share) for n in lengths]
    return turn if session.context_after(turn.messages()) < max_context else None
