"""Sessions: every call of one agent run recorded in the token ledger, exactly as sampled.

A session holds branches; a branch is a `ChatSession` (one ledger segment stream) plus the conversation as
the agent sees it (`history`: its messages, with the gateway's replies in place) and one checkpoint per call
(where the call's prompt ended in the ledger, the reply, where the reply ended). For each request:

1. Find the branch whose history shares the longest prefix with the request's messages, comparing
   messages up to whitespace/key order of tool-call JSON and call ids, and replies by `Reply.matches`.
2. Take the deepest checkpoint k whose prompt lies within that prefix.
   - The request is prompt k plus reply k plus new messages (tool results, user turns): the new messages are
     appended to the ledger as chat-template deltas (`ChatSession.add_environment`): in place when k is the
     branch's last call and no call is in flight on it, else on a fork of the branch cut back to reply k.
     The policy's tokens are never re-tokenized: the agent's copy of a reply is only used to recognise it.
   - The request is prompt k again (a retry, `n` > 1, fan-out of identical calls): a fork cut back to prompt
     k samples a sibling reply.
   - Anything else is a *break*: the agent rewrote or dropped a reply, truncated or summarized history.
     The request starts a new branch from a full render, and the reason is recorded. A request that shares
     not even its first message with earlier calls starts a new *conversation* (a sub-agent), not a break.
3. The engine samples from the branch's ledger tokens, so the ledger is exactly what the policy saw. A forced
   tool-call opening (`tool_choice: required` or a named function) is appended to them first, as template
   tokens (no loss); the reply's message, which the agent echoes, holds it and the sampled text.

Forks copy the ledger up to the fork point; inherited policy tokens become context there (source PROMPT,
no loss) so that each sampled token is trained once, in the branch that sampled it. `close` merges the
branches into one `Trajectory`, one segment per branch (a training sample each, sharing the session's
reward), with parity `exact` / `token_drift` / `mismatch` over all branches, or `split` after breaks,
the reasons in `metrics["breaks"]`. `rollout.on_mismatch: error` also records each break as a `chat` error,
which masks the trajectory; `warn` and `split` train on every branch.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
from typing import Any

from turnrl.chat.predict import Guesses
from turnrl.chat.session import ChatMismatchError, ChatSession
from turnrl.chat.templates import ChatTemplate
from turnrl.gateway.replies import Reply
from turnrl.gateway.requests import Message
from turnrl.ledger import Segment, Source, ToolResult, Trajectory, Turn


@dataclass(frozen=True)
class Mark:
    """A point in a branch's ledger: everything after it was appended later (appends only)."""
    segments: int
    length: int
    turns: int
    messages: int
    errors: int
    text: str


def mark(chat: ChatSession) -> Mark:
    t = chat.traj
    return Mark(len(t.segments), len(t.segment), len(t.turns), len(t.messages), len(t.errors), chat._text)


def rewind(chat: ChatSession, m: Mark) -> None:
    t = chat.traj
    del t.segments[m.segments:]
    seg = t.segment
    for values in (seg.token_ids, seg.sources, seg.turns, seg.logprobs, seg.loss_mask):
        del values[m.length:]
    del t.turns[m.turns:], t.messages[m.messages:], t.errors[m.errors:]
    chat._text = m.text


@dataclass
class Checkpoint:
    prompt_len: int                  # messages in the call's request
    before: Mark                     # the ledger with the call's prompt (generation prompt included)
    reply: Reply | None = None       # None while the call is in flight
    after: Mark | None = None


@dataclass
class Branch:
    chat: ChatSession
    tools: list[dict[str, Any]]
    history: list[Message | Reply] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    busy: bool = False
    tools_key: str | None = None     # `predict.Guesses.tools_key` of the prepared tools, once asked

    def common_prefix(self, messages: list[Message]) -> int:
        n = 0
        for mine, theirs in zip(self.history, messages):
            if not (mine.matches(theirs) if isinstance(mine, Reply) else mine.same(theirs)):
                break
            n += 1
        return n

    def tool_name(self, call_id: str) -> str:
        for entry in reversed(self.history):
            if isinstance(entry, Reply) and call_id in entry.call_ids:
                return entry.calls[entry.call_ids.index(call_id)].name
        return ""


@dataclass
class Call:
    """One request in flight: its branch, its checkpoint, and how to undo it if it fails."""
    branch: Branch
    checkpoint: Checkpoint
    created: bool                    # the branch was made for this call (undo: drop it)
    undo: Mark | None = None         # else: the ledger before the call's new messages
    history_len: int = 0

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.branch.chat.context_ids)


class Session:
    def __init__(self, sid: str, template: ChatTemplate, on_mismatch: str = "error", group_id: str = "",
                 sample_index: int = 0, info: dict[str, Any] | None = None, native_tools: bool | None = None):
        self.id = sid
        self.template = template
        self.on_mismatch = on_mismatch
        self.group_id = group_id or sid
        self.sample_index = sample_index
        self.info = dict(info or {})
        self.native_tools = template.native_tools if native_tools is None else native_tools
        self.branches: list[Branch] = []
        self.text_calls: list[Trajectory] = []   # /v1/completions calls: raw tokens, no chat template
        self.breaks: list[str] = []
        self.conversations = 0
        self.forks = 0
        self.calls = 0
        self.aborted = 0
        self.turn = 0
        self.last: Branch | None = None
        self.created = time.time()
        self.closed = False
        self._deferred: list[tuple[Call, Reply]] = []   # answered, not yet committed (`defer`)

    # -- one call ------------------------------------------------------------------------------------
    def begin(self, messages: list[Message], tools: list[dict[str, Any]]) -> Call:
        """Place a request in the ledger (see the module docstring); returns the call to sample for."""
        self.settle()
        candidates = [(b.common_prefix(messages), not b.busy, i, b) for i, b in enumerate(self.branches)
                      if b.tools == tools]
        if not candidates:
            if self.branches:
                self.conversations += 1
            return self._root(messages, tools)
        common, _, _, branch = max(candidates, key=lambda c: c[:3])
        k = next((j for j in range(len(branch.checkpoints) - 1, -1, -1)
                  if branch.checkpoints[j].prompt_len <= common), None)
        if k is None:
            if common == 0:
                self.conversations += 1
                return self._root(messages, tools)
            return self._break(messages, tools, f"message {common} ({messages[common].role if common < len(messages) else 'end'}) "
                                                "departs from the first call's prompt")
        cp = branch.checkpoints[k]
        if common == cp.prompt_len == len(messages):
            return self._start(self._fork(branch, k, messages, sibling=True), cp.prompt_len, created=True)
        if common > cp.prompt_len:
            new = messages[cp.prompt_len + 1:]
            if k == len(branch.checkpoints) - 1 and not branch.busy and common == len(branch.history):
                return self._extend(branch, messages, new, created=False)
            fork = self._fork(branch, k, messages[:cp.prompt_len + 1], sibling=False)
            return self._extend(fork, messages, new, created=True)
        what = messages[common]
        if cp.reply is None:
            reason = f"message {common} ({what.role}) follows call {k}'s prompt while its reply is still being sampled"
        elif what.role == "assistant":
            reason = f"message {common} (assistant) differs from the reply the gateway sampled there"
        else:
            reason = f"message {common} ({what.role}) stands where the gateway's reply was: the reply was dropped"
        return self._break(messages, tools, reason)

    def guess(self, messages: list[Message], tools: list[dict[str, Any]], guesses: Guesses
              ) -> tuple[list[int], tuple[str, list[dict[str, Any]]]] | None:
        """The prompt `begin` would give this request, guessed cheaply for the common case (the last call's
        branch, its reply echoed, new tool/user messages after it; their text from `guesses`, no full render),
        and what to `forget` if it proves wrong; None: no guess. Only a guess: `begin` decides, and the
        gateway compares (see `Gateway.chat`)."""
        self.settle()
        branch = self.last
        if branch is None or branch.busy or self.closed or branch.tools != tools:
            return None
        h = len(branch.history)
        last = branch.history[-1] if branch.history else None
        if len(messages) <= h or not isinstance(last, Reply) or not last.matches(messages[h - 1]):
            return None
        new = messages[h:]
        if any(m.role == "assistant" for m in new):
            return None
        sent = {c[0]: c[1] for c in messages[h - 1].tool_calls}
        converted = [self._template_message(m, m.name or sent.get(m.tool_call_id) or branch.tool_name(m.tool_call_id))
                     for m in new]
        chat = branch.chat
        if not chat.traj.messages or chat.traj.messages[-1].get("role") != "assistant":
            return None
        if branch.tools_key is None:
            branch.tools_key = Guesses.tools_key(chat.render_tools)
        delta = guesses.delta(branch.tools_key, chat.render_tools, converted)
        if delta is None:
            return None
        return chat.context_ids + self.template.encode(chat._glue() + delta), (branch.tools_key, converted)

    def commit(self, call: Call, reply: Reply) -> None:
        branch, cp = call.branch, call.checkpoint
        turn = branch.chat.add_assistant(reply.token_ids, reply.logprobs, reply.finish_reason, self._next_turn(),
                                         reply.forced_ids)
        turn.tool_calls = list(reply.calls) + list(reply.bad_calls)
        for bad in reply.bad_calls:
            branch.chat.traj.add_error("tool_parse", bad.error or "malformed tool call", turn.index, blame="policy")
        cp.reply, cp.after = reply, mark(branch.chat)
        branch.history.append(reply)
        branch.busy = False
        self.calls += 1
        self.last = branch

    def defer(self, call: Call, reply: Reply) -> None:
        """`commit` later, once the answer is on its way: the call stays busy until then, and every other use
        of the session (`begin`, `guess`, `abort`, `sibling`, `record_text`, `close`, and the gateway's
        look-up of the session for any request) settles first, so each sees the session as if committed."""
        self._deferred.append((call, reply))

    def settle(self) -> None:
        """Commit the deferred replies, in the order they came."""
        while self._deferred:
            self.commit(*self._deferred.pop(0))

    def force(self, call: Call, ids: list[int]) -> None:
        """Put a forced opening (a tool call's start) after the call's prompt: template tokens the engine
        continues from. It lies after the checkpoint's `before`, so a retry or sibling of this prompt starts
        without it, and `abort` or `close` undoes it with the call."""
        if ids:
            call.branch.chat.add_forced(ids, self.turn)

    def abort(self, call: Call) -> None:
        """Undo a call that produced no reply (engine error, client gone, context too long)."""
        self.settle()
        branch = call.branch
        branch.busy = False
        self.aborted += 1
        if call.created:
            self.branches.remove(branch)
            return
        branch.checkpoints.pop()
        del branch.history[call.history_len:]
        if call.undo is not None:
            rewind(branch.chat, call.undo)

    def sibling(self, call: Call) -> Call:
        """Another sample for the same prompt (request `n` > 1)."""
        self.settle()
        k = len(call.branch.checkpoints) - 1
        fork = self._fork(call.branch, k, call.branch.history[:call.checkpoint.prompt_len], sibling=True)
        return self._start(fork, call.checkpoint.prompt_len, created=True)

    def record_text(self, prompt: list[int], ids: list[int], logprobs: list[float], finish: str, text: str) -> None:
        """A text completion: its prompt and sampled tokens as one segment of its own."""
        self.settle()
        traj = Trajectory(group_id=self.group_id, sample_index=self.sample_index, messages=[])
        turn = self._next_turn()
        traj.segment.append(prompt, Source.PROMPT, turn)
        traj.segment.append(ids, Source.POLICY, turn, logprobs)
        traj.turns.append(Turn(turn, 0, len(prompt), len(prompt) + len(ids), finish, text))
        traj.messages = [{"role": "user", "content": self.template.decode(prompt)}, {"role": "assistant", "content": text}]
        self.text_calls.append(traj)
        self.calls += 1

    # -- branches ------------------------------------------------------------------------------------
    def _next_turn(self) -> int:
        self.turn += 1
        return self.turn - 1

    def _start(self, branch: Branch, prompt_len: int, created: bool, undo: Mark | None = None,
               history_len: int = 0) -> Call:
        cp = Checkpoint(prompt_len, mark(branch.chat))
        branch.checkpoints.append(cp)
        branch.busy = True
        return Call(branch, cp, created, undo, history_len)

    def _root(self, messages: list[Message], tools: list[dict[str, Any]]) -> Call:
        traj = Trajectory(group_id=self.group_id, sample_index=self.sample_index, messages=[], info=dict(self.info))
        names = {c[0]: c[1] for m in messages for c in m.tool_calls}
        chat = ChatSession(self.template, [self._template_message(m, names.get(m.tool_call_id, "")) for m in messages],
                           tools, traj, self.on_mismatch)
        for seg in traj.segments:   # the prompt's tokens continue the session's turn numbering
            seg.turns[:] = [self.turn] * len(seg)
        branch = Branch(chat, tools, list(messages))
        self.branches.append(branch)
        return self._start(branch, len(messages), created=True)

    def _break(self, messages: list[Message], tools: list[dict[str, Any]], reason: str) -> Call:
        self.breaks.append(f"call {self.calls + 1}: {reason}")
        return self._root(messages, tools)

    def _fork(self, branch: Branch, k: int, history: list[Message | Reply], sibling: bool) -> Branch:
        """A new branch cut back to call k's prompt (`sibling`) or to its reply."""
        cp = branch.checkpoints[k]
        at = cp.before if sibling else cp.after
        assert at is not None
        chat = copy.copy(branch.chat)
        chat.traj = _cut_copy(branch.chat.traj, at)
        chat._text = at.text
        fork = Branch(chat, branch.tools, list(history), [copy.copy(c) for c in branch.checkpoints[:k + (0 if sibling else 1)]])
        self.branches.append(fork)
        self.forks += 1
        return fork

    def _extend(self, branch: Branch, messages: list[Message], new: list[Message], created: bool) -> Call:
        history_len = len(branch.history)
        undo = mark(branch.chat)
        prior = branch.chat.traj.turns[-1] if branch.chat.traj.turns else None
        sent = {c[0]: c[1] for m in messages for c in m.tool_calls}   # the agent's own call ids
        names = [m.name or sent.get(m.tool_call_id) or branch.tool_name(m.tool_call_id) for m in new]
        converted = [self._template_message(m, name) for m, name in zip(new, names)]
        try:
            branch.chat.add_environment(converted, prior.index if prior else self.turn)
        except ChatMismatchError as exc:   # only with on_mismatch 'error': record it as a break
            rewind(branch.chat, undo)
            if created:
                self.branches.remove(branch)
            return self._break(messages, branch.tools, f"the chat template is not append-only here: {exc}")
        if prior is not None:
            prior.tool_results += [ToolResult(name or "tool", m.content, m.tool_call_id)
                                   for m, name in zip(new, names) if m.role == "tool"]
        branch.history.extend(new)
        return self._start(branch, len(messages), created, undo, history_len)

    def _template_message(self, m: Message, tool_name: str) -> dict[str, Any]:
        if m.role == "tool":
            return self.template.tool_message(m.name or tool_name or "tool", m.content, m.tool_call_id)
        if m.role == "assistant" and m.tool_calls:
            calls = [{"name": name, "arguments": _json_or_text(args)} for _, name, args in m.tool_calls]
            if self.native_tools:
                return {"role": "assistant", "content": m.content,
                        "tool_calls": [{"type": "function", "function": c} for c in calls]}
            text = "\n".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls)
            return {"role": "assistant", "content": f"{m.content}\n{text}" if m.content else text}
        return {"role": m.role, "content": m.content}

    # -- the record ----------------------------------------------------------------------------------
    def close(self) -> Trajectory:
        """Merge the branches into one trajectory (one segment per branch that sampled something)."""
        self.settle()
        self.closed = True
        for branch in self.branches:
            if branch.busy:   # the agent returned while a call was in flight: that call left nothing
                branch.busy = False
                if branch.checkpoints and branch.checkpoints[-1].reply is None:
                    rewind(branch.chat, branch.checkpoints.pop().before)
        used = [b for b in self.branches if b.chat.traj.turns]
        main = self.last if self.last in used else (used[-1] if used else None)
        traj = Trajectory(group_id=self.group_id, sample_index=self.sample_index, messages=[], segments=[],
                          info=dict(self.info))
        results = [branch.chat.finish() for branch in used] + ["exact"] * len(self.text_calls)
        for part in [b.chat.traj for b in used] + self.text_calls:
            offset = len(traj.segments)
            traj.segments += part.segments
            for turn in part.turns:
                turn.segment += offset
                traj.turns.append(turn)
            traj.errors += part.errors
            if part.masked:
                traj.mask(part.mask_reason)
            traj.policy_version = max(traj.policy_version, part.policy_version)
        traj.turns.sort(key=lambda t: t.index)
        record = main.chat.traj if main is not None else (self.text_calls[-1] if self.text_calls else None)
        if record is not None:
            traj.messages, traj.tools = record.messages, record.tools
            traj.termination = "eos" if record.turns[-1].finish_reason == "stop" else "token_budget"
        else:
            traj.segments = [Segment()]
            traj.termination = "error"
            traj.add_error("agent", "the agent made no model calls in its session")
        traj.parity = ("mismatch" if "mismatch" in results else "split" if self.breaks or "split" in results
                       else "token_drift" if "token_drift" in results else "exact" if results else "")
        if self.breaks:
            traj.metrics["breaks"] = list(self.breaks)
            if self.on_mismatch == "error":
                for reason in self.breaks:
                    traj.add_error("chat", f"history break: {reason} (set rollout.on_mismatch to split to train "
                                           "on every branch)")
        traj.metrics.update({"gateway/calls": self.calls, "gateway/branches": len(used) + len(self.text_calls), "gateway/breaks": len(self.breaks),
                             "gateway/forks": self.forks, "gateway/conversations": self.conversations + bool(used),
                             "gateway/aborted": self.aborted})
        traj.info["session"] = self.id
        traj.check()
        return traj


def _cut_copy(traj: Trajectory, at: Mark) -> Trajectory:
    """A copy of `traj` up to `at`, its policy tokens turned into context (they train in the original)."""
    out = copy.copy(traj)
    out.segments = [copy.deepcopy(s) for s in traj.segments[:at.segments]]
    seg = out.segments[-1]
    for values in (seg.token_ids, seg.sources, seg.turns, seg.logprobs, seg.loss_mask):
        del values[at.length:]
    for s in out.segments:
        for i, source in enumerate(s.sources):
            if source == Source.POLICY:
                s.sources[i], s.logprobs[i], s.loss_mask[i] = int(Source.PROMPT), 0.0, 0
    out.turns = []
    out.messages = [dict(m) for m in traj.messages[:at.messages]]
    out.errors = list(traj.errors[:at.errors])
    out.metrics, out.timings, out.info = dict(traj.metrics), dict(traj.timings), dict(traj.info)
    return out


def _json_or_text(args: str) -> Any:
    try:
        return json.loads(args)
    except ValueError:
        return args
