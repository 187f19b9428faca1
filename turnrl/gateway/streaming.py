"""Streamed chat replies: the content an agent may see while the tokens are still being sampled.

`ContentStream.feed(ids)` takes the tokens sampled so far and returns the content that has become safe to
send, never text the finished reply will not have:
- not past a possible tool call: with tools on, content stops before the first of the parser's
  `call_markers` (hermes `<tool_call>`, pythonic `[`, ...), and a tail that could be the start of one waits
  for the next tokens; the calls themselves go out at the end, parsed, as `tool_calls`;
- not past a stop string (nor a tail that could begin one), as the reply's content is cut there;
- not the end-of-turn token, nor a trailing incomplete UTF-8 character (decoded as U+FFFD);
- not leading whitespace (the reply's content is stripped).
A forced call opening (`tool_choice: required`) starts the text, so nothing of a forced call is streamed.
`finish(reply)` returns what is left of the reply's content after what was sent. The concatenated deltas
are the reply's content, up to whitespace at its end, which `Reply.matches` ignores when the agent sends
the message back, so a streamed reply keeps its session's trajectory exact like a plain one.
"""

from __future__ import annotations

from turnrl.chat.parsers import ToolCallParser
from turnrl.chat.templates import ChatTemplate
from turnrl.gateway.replies import Reply


class ContentStream:
    def __init__(self, template: ChatTemplate, parser: ToolCallParser | None, stops: list[str],
                 forced_ids: list[int] | tuple[int, ...] = ()):
        self.template = template
        self.markers = tuple(getattr(parser, "call_markers", ("",))) if parser is not None else ()
        self.stops = [s for s in stops if s]
        self.forced = list(forced_ids)
        self.ids: list[int] = []
        self.sent = ""
        self.closed = False            # the rest waits for the finished reply

    def feed(self, token_ids: list[int]) -> str:
        self.ids += token_ids
        if self.closed:
            return ""
        body = self.ids[:-1] if self.ids and self.ids[-1] in self.template.stop_token_ids else self.ids
        text = self.template.decode(self.forced + body)
        if text.endswith("\ufffd"):
            text = text[:-1]
        safe = len(text)
        for cut in self.markers + tuple(self.stops):
            at = text.find(cut) if cut else 0
            if at >= 0:
                safe = min(safe, at)
                self.closed = True
            else:
                safe = min(safe, len(text) - _partial_tail(text, cut))
        head = text[:safe]
        if not head.strip() or not head.lstrip().startswith(self.sent):
            return ""
        delta = head.lstrip()[len(self.sent):]
        self.sent += delta
        return delta

    def finish(self, reply: Reply) -> str:
        content = reply.content or ""
        if not content.startswith(self.sent):
            return ""
        return content[len(self.sent):]


def _partial_tail(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
