"""Token-exact chat sessions: append environment turns as token deltas, never re-tokenize policy tokens.

Algorithm (per environment turn, after the policy's assistant turn was appended token by token):
1. `full` = render(messages + new ones, generation prompt on).
2. `hist`, the render of the conversation so far, is the ledger's text plus the rest of the template's
   assistant suffix: template glue the policy did not write (ChatML: the `\\n` after `<|im_end|>`, which
   generation stops before; or the whole `<|im_end|>\\n` when a turn was cut by its token limit). This is where
   verl loses the `\\n`. When `full` starts with that text, the appended delta makes the ledger equal `full`,
   the exact next prompt, and no other render is needed. Otherwise `hist` is rendered: the ledger's text must be
   a prefix of it, and `full` must extend it.
3. The delta `full[len(hist):]` holds the new messages and the next generation prompt; a render up to each new
   message but the last marks where it ends (the last ends where `full`'s generation prompt begins).
4. glue + delta is tokenized as one string (special tokens split it exactly as in a full render), and each
   token gets its source (template, tool, user) from its character offset.
If step 2 fails, the template is not append-only here (trimmed content, reasoning stripped from past
turns, ...). `on_mismatch` decides: `error` raises, `warn` appends the template's own delta and counts it,
`split` starts a new segment (a new training sample) from a full re-render of the conversation. (A template
that writes the latest assistant turn differently only while it is the last message, as Qwen3's thinking
mode does with an empty thinking block, breaks nothing here: the next prompt continues the ledger exactly; the
final parity check reports what the last turn's render adds.)

Each assistant message keeps the reply's leading `<think>...</think>` as `reasoning_content` and the rest as
`content` (`ChatTemplate.split_reasoning`); renders join them back, so the split is invisible to parity.

At the end, `finish` closes the last assistant turn and compares the ledger with a full re-render of its
messages: `exact` (same token ids), `token_drift` (same text, other token ids: the policy sampled a
non-canonical tokenization, or the tokenizer merges differently across the end of the generation prompt, e.g.
a `\n\n` that ends the prompt is one token but splits before the reply in a full render; harmless here, fatal
for frameworks that re-tokenize), or `mismatch`.
"""

from __future__ import annotations

import bisect
import copy
from typing import Any

from turnrl.chat.templates import ChatTemplate, TemplateError
from turnrl.ledger import Source, Trajectory, Turn

ROLE_SOURCE = {"tool": Source.TOOL, "user": Source.USER, "system": Source.PROMPT, "assistant": Source.PROMPT}


class ChatMismatchError(RuntimeError):
    """The chat template is not append-only at this turn and on_mismatch is 'error'."""


def first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def describe_mismatch(expected: str, actual: str, context: int = 40) -> str:
    i = first_difference(expected, actual)
    return (f"at char {i}: template renders {expected[max(0, i - context):i + context]!r} "
            f"but the ledger holds {actual[max(0, i - context):i + context]!r}")


class ChatSession:
    """Builds a trajectory's token ledger turn by turn."""

    def __init__(self, template: ChatTemplate, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                 traj: Trajectory, on_mismatch: str = "error"):
        if on_mismatch not in ("error", "warn", "split"):
            raise ValueError(f"on_mismatch must be error, warn or split, got {on_mismatch!r}")
        self.template = template
        self.on_mismatch = on_mismatch
        self.traj = traj
        traj.messages, self.render_tools = template.prepare(messages, tools)
        traj.tools = list(tools)
        text = self._render(traj.messages, generation=True)
        traj.segment.append(template.encode_prompt(text), Source.PROMPT, turn=0)
        self._text = text            # the current segment's text, kept in step with its tokens
        self.mismatches = 0
        self._last_prompt: tuple[Any, list[dict[str, Any]], str] | None = None
        self._encoded: tuple[str, list[int], list[tuple[int, int]]] | None = None

    @property
    def context_ids(self) -> list[int]:
        return self.traj.segment.token_ids

    def _render(self, messages: list[dict[str, Any]], generation: bool = False) -> str:
        return self.template.render(messages, self.render_tools, add_generation_prompt=generation)

    def add_forced(self, token_ids: list[int], turn: int) -> None:
        """Tokens put ahead of the policy's reply (a forced tool-call opening): context it continues from,
        not sampled, so TEMPLATE (no loss); the next `add_assistant` counts them in its message's text."""
        self.traj.segment.append(token_ids, Source.TEMPLATE, turn)
        self._text += self.template.decode(token_ids)

    def add_assistant(self, token_ids: list[int], logprobs: list[float], finish_reason: str, turn: int,
                      forced: list[int] | tuple[int, ...] = ()) -> Turn:
        """`forced`: the ids `add_forced` appended just before; the message's text starts with them, while the
        turn's span holds the sampled tokens only."""
        seg = self.traj.segment
        start = len(seg)
        seg.append(token_ids, Source.POLICY, turn, logprobs)
        text = self.template.decode(token_ids)
        self._text += text
        forced = list(forced)
        content = self.template.decode(forced + token_ids) if forced else text
        if finish_reason == "stop" and token_ids and token_ids[-1] in self.template.stop_token_ids:
            content = self.template.decode(forced + token_ids[:-1])
        reasoning, answer = self.template.split_reasoning(content)
        message = {"role": "assistant", "content": answer}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        self.traj.messages.append(message)
        record = Turn(index=turn, segment=len(self.traj.segments) - 1, start=start, end=len(seg),
                      finish_reason=finish_reason, text=content)
        self.traj.turns.append(record)
        return record

    def add_environment(self, new_messages: list[dict[str, Any]], turn: int) -> int:
        """Append tool/user messages and the next generation prompt; returns the number of tokens added."""
        messages = self.traj.messages
        full = self._next_prompt(new_messages)
        hist = self._history(full)
        if hist is None:
            hist = self._render(messages)
            if not hist.startswith(self._text):
                return self._mismatch(hist, new_messages, turn, describe_mismatch(hist, self._text))
            if not full.startswith(hist):
                return self._mismatch(hist, new_messages, turn, describe_mismatch(full, hist) + " (past turns change)")
        pieces = [(hist[len(self._text):], Source.TEMPLATE)]
        pieces += self._message_pieces(messages, new_messages, hist, full)
        messages.extend(new_messages)
        return self._append_pieces(pieces, turn)

    def _next_prompt(self, new_messages: list[dict[str, Any]]) -> str:
        """render(messages + new ones, generation prompt on), remembered for the last new messages: the agent
        loop asks `context_after` before `add_environment` with the same messages (a cut tool result is other
        messages, and renders anew). The key is the trajectory, its message count and the ledger's text, which
        every change to the conversation so far changes."""
        key = (id(self.traj), len(self.traj.messages), self._text)
        last = self._last_prompt
        if last is not None and last[0] == key and last[1] == new_messages:
            return last[2]
        full = self._render(self.traj.messages + new_messages, generation=True)
        self._last_prompt = (key, copy.deepcopy(new_messages), full)
        return full

    def _history(self, full: str) -> str | None:
        """The render of the conversation so far, read off `full` (the render with the new messages) without
        rendering it again, when the ledger ends with an assistant turn that `full` continues exactly: the
        ledger's text, then the rest of the template's assistant suffix (ChatML: the `\\n` after `<|im_end|>`,
        or all of `<|im_end|>\\n` after a turn cut by its limit). None: render it (the checks then say why not).
        Either way the appended tokens make the ledger equal `full`; this only saves a render per turn."""
        if not self.traj.messages or self.traj.messages[-1].get("role") != "assistant":
            return None
        hist = self._text + self._glue()
        return hist if full.startswith(hist) else None

    def _message_pieces(self, messages: list[dict[str, Any]], new_messages: list[dict[str, Any]], hist: str,
                        full: str) -> list[tuple[str, Source]]:
        """Split the delta `full[len(hist):]` into per-message pieces with their sources. The last message ends
        where the generation prompt begins when `full` ends with the template's generation prompt; the others
        (and the last, where it does not) end where a render up to them ends."""
        pieces: list[tuple[str, Source]] = []
        prev = hist
        opener = self._generation_prompt()
        for k in range(1, len(new_messages) + 1):
            if k == len(new_messages) and opener and full.endswith(opener) and len(full) - len(opener) >= len(prev):
                text = full[:len(full) - len(opener)]
            else:
                text = self._render(messages + new_messages[:k])
            if not text.startswith(prev) or not full.startswith(text):
                # The template regroups messages (e.g. several tool results in one block): attribute the
                # whole delta to the first new message's role.
                role = ROLE_SOURCE.get(new_messages[0].get("role", "user"), Source.USER)
                body = self._render(messages + new_messages)
                return [(body[len(hist):], role), (full[len(body):], Source.TEMPLATE)]
            pieces.append((text[len(prev):], ROLE_SOURCE.get(new_messages[k - 1].get("role", "user"), Source.USER)))
            prev = text
        pieces.append((full[len(prev):], Source.TEMPLATE))
        return pieces

    def _generation_prompt(self) -> str:
        try:
            return self.template.generation_prompt
        except TemplateError:
            return ""

    def _append_pieces(self, pieces: list[tuple[str, Source]], turn: int) -> int:
        text = "".join(p for p, _ in pieces)
        if not text:
            return 0
        ids, offsets = self._encode(text)
        ends, sources, at = [], [s for _, s in pieces], 0
        for piece, _ in pieces:
            at += len(piece)
            ends.append(at)
        seg = self.traj.segment
        run_source, run = None, []
        for tok, (begin, _) in zip(ids, offsets):
            # the piece the token starts in: the first whose end is past its first character (the last if none)
            source = sources[min(bisect.bisect_right(ends, begin), len(sources) - 1)]
            if source != run_source and run:
                seg.append(run, run_source, turn)
                run = []
            run_source = source
            run.append(tok)
        if run:
            seg.append(run, run_source, turn)
        self._text += text
        return len(ids)

    def _mismatch(self, hist: str, new_messages: list[dict[str, Any]], turn: int, detail: str) -> int:
        self.mismatches += 1
        self.traj.metrics["chat_mismatches"] = self.mismatches
        if self.on_mismatch == "error":
            raise ChatMismatchError(f"chat template is not append-only at turn {turn}: {detail}. "
                                    "Set rollout.on_mismatch to 'split' (new training sample at the break) "
                                    "or 'warn'.")
        messages = self.traj.messages
        full = self._next_prompt(new_messages)
        if self.on_mismatch == "split":
            messages.extend(new_messages)
            self.traj.segments.append(type(self.traj.segment)())
            self.traj.segment.append(self.template.encode(full), Source.PROMPT, turn)
            self._text = full
            self.traj.parity = "split"
            return len(self.traj.segment)
        # warn: keep what the policy saw, close its turn with the template's glue, append the template's delta
        glue, delta = self._glue(), self._warn_delta(hist, full, new_messages)
        messages.extend(new_messages)
        role = ROLE_SOURCE.get(new_messages[0].get("role", "user"), Source.USER) if new_messages else Source.USER
        return self._append_pieces([(glue, Source.TEMPLATE), (delta, role)], turn)

    def _warn_delta(self, hist: str, full: str, new_messages: list[dict[str, Any]]) -> str:
        if full.startswith(hist):
            return full[len(hist):]
        anchor = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
        base = self._render(anchor)
        return self._render(anchor + new_messages, generation=True)[len(base):]

    def context_after(self, new_messages: list[dict[str, Any]]) -> int:
        """The length the current segment would have after `add_environment(new_messages)` (nothing changes)."""
        messages = self.traj.messages
        full = self._next_prompt(new_messages)
        if self._history(full) is None:
            hist = self._render(messages)
            if not (hist.startswith(self._text) and full.startswith(hist)):
                if self.on_mismatch == "split":
                    return len(self.template.encode(full))
                # warn (with 'error', add_environment raises)
                delta = self._glue() + self._warn_delta(hist, full, new_messages)
                return len(self.context_ids) + len(self.template.encode(delta))
        return len(self.context_ids) + len(self._encode(full[len(self._text):])[0])

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The template's encoding of a delta with offsets, remembered for the last text: `context_after` and the
        `add_environment` after it encode the same delta."""
        if self._encoded is None or self._encoded[0] != text:
            self._encoded = (text, *self.template.encode_with_offsets(text))
        return self._encoded[1], self._encoded[2]

    def _glue(self) -> str:
        """The template's assistant suffix minus what the policy already wrote of it."""
        suffix = self.template.assistant_suffix
        last = self.traj.turns[-1] if self.traj.turns else None
        if last is not None and last.finish_reason == "stop":
            stop_text = self.template.decode(self.context_ids[last.end - 1:last.end])
            if suffix.startswith(stop_text):
                return suffix[len(stop_text):]
        return suffix

    def finish(self) -> str:
        """Close the last turn and check parity with a full re-render; returns exact|token_drift|mismatch."""
        full = self.close()
        return self.judge(full, self.template.encode(full))

    def close(self) -> str:
        """Close the last turn (the template's tokens after the last assistant message) -> the full re-render of
        the conversation, whose tokens `judge` compares with the ledger's. `finish` is both; a caller that
        tokenizes elsewhere (the agent loop, in batches off its event loop) calls the two."""
        messages = self.traj.messages
        ends_with_assistant = bool(messages) and messages[-1]["role"] == "assistant"
        full = self._render(messages, generation=not ends_with_assistant)
        if ends_with_assistant and self.traj.turns:
            if full.startswith(self._text):
                closing = full[len(self._text):]
            else:  # the ledger already differs (on_mismatch 'warn'): close the turn as `add_environment` does
                closing = self._glue() if not self._text.endswith(self.template.assistant_suffix) else ""
            if closing:
                self._append_pieces([(closing, Source.TEMPLATE)], self.traj.turns[-1].index)
        return full

    def judge(self, full: str, canonical: list[int]) -> str:
        """Parity of the ledger against `full` (from `close`) and its tokens; returns exact|token_drift|mismatch."""
        seg = self.traj.segment
        # Decoded only when the ids differ (most ledgers are exact).
        ledger_text = None if canonical == seg.token_ids else self.template.decode(seg.token_ids)
        if ledger_text is None:
            result = "exact"
        elif ledger_text == full or ledger_text == self.template.decode(canonical):
            # The second test: text the tokenizer cannot spell (e.g. an unassigned code point, encoded as
            # fallback bytes) decodes to something else in both, and is no mismatch.
            result = "token_drift"
        else:
            result = "mismatch"
            self.traj.metrics["parity_detail"] = describe_mismatch(full, ledger_text)
        if self.traj.parity != "split" or result == "mismatch":
            self.traj.parity = result
        return result
