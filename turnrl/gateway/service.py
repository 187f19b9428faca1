"""The gateway's core, without HTTP: sessions, one chat or text completion at a time, the OpenAI answers.

`Gateway.chat(request, session)` places the request in the session's ledger (`capture.Session.begin`), samples
from the ledger's tokens with the engine, builds the reply (`replies.build_reply`) and commits it; a call
that fails (engine error, prompt over the context, the client going away: its `generate` is cancelled, which
aborts the engine request) is undone, so no request, however bad, changes a trajectory. Without a session
the messages are rendered and served, and nothing is recorded.

Guessed prompts: placing a call (matching it to a branch, rendering the whole conversation to check that the
template only appended, tokenizing the new part) is most of the gateway's own time, and the engine needs only its
result. So for the common call (the last reply echoed, new tool or user messages after it) the prompt is guessed
first (`Session.guess`: the ledger plus the new messages' text from `chat.predict`, no full render), the engine
starts on it, and the call is placed the usual way while the engine samples. The sample is used only when the
placed call's prompt and sampling equal the guess token for token; otherwise it is cancelled (its engine request
aborted), the call samples from its own prompt, and that shape is not guessed again. `stats` counts both.

Deferred commits: over HTTP (`chat(..., defer=True)`) the replies are written into the session's ledger after the
answer is sent, not before (`Session.defer`); every later use of the session settles them first, so nothing
sees a call half-recorded, and the trajectory is the one an immediate commit makes (`tests/gateway/test_defer.py`).

Sampling: the request's temperature, top_p, max_tokens, seed and stop apply, the defaults coming from the
config (`Defaults`). With `pin_sampling` (sessions the trainer runs), temperature and top_p stay the
config's whatever the agent asks, since the trainer recomputes logprobs at the config's temperature; a
request that asked otherwise is counted (`gateway/sampling_overridden`). `max_tokens` is capped by the
context left and by `Defaults.max_tokens_cap`.

Tool choice: `none` turns the parser off; `auto` lets the model choose. `required` and a named function are
enforced by decoding from a forced opening: the parser's call opening (`forced_opening`: hermes
`<tool_call>\n{"name": "`, or with the name and `"arguments":`) is tokenized and appended to the prompt the
engine continues from, so every reply is a call (of that function) unless it runs out of tokens. The opening
was not sampled: in a session it is recorded as template tokens (loss mask 0), and the reply's text, which the
agent receives and echoes, starts with it. A format that cannot write the opening (a named call for mistral or
deepseek_v3, whose syntax depends on the model's version) or a generation prompt that opens `<think>` (the call
would sit inside the reasoning, which parsers ignore) is a 400.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from turnrl.chat.parsers import CannotForce, ToolCallParser
from turnrl.chat.predict import Guesses
from turnrl.chat.templates import ChatTemplate
from turnrl.engines.base import Completion, Delta, Engine, EngineError, Sampling
from turnrl.engines import resume
from turnrl.gateway.capture import Session
from turnrl.gateway.replies import Reply, build_reply, cut_at_stop, new_id
from turnrl.gateway.requests import APIError, ChatRequest, CompletionRequest, Sampled
from turnrl.gateway.streaming import ContentStream
from turnrl.ledger import Trajectory
from turnrl.rollout.loop import request_seed


@dataclass(frozen=True)
class Defaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256            # when the request gives none
    max_tokens_cap: int | None = None
    max_context: int = 4096
    seed: int = 0


@dataclass
class _Call:
    """A chat request placed in its session: the session's calls (one per choice; none when unrecorded), the
    prompt the engine continues, how to sample, the parser (None: tools off) and the forced call opening."""
    session: Session | None
    calls: list[Any]
    prompt: list[int]
    sampling: Sampling | None
    parser: ToolCallParser | None
    forced: list[int]


@dataclass
class Answer:
    """A finished call: the replies (one per choice) and what the usage block reports."""
    id: str
    created: int
    model: str
    replies: list[Reply]
    prompt_tokens: int
    engine_s: float = 0.0            # waiting for the engine (the rest of a call's time is the gateway's)
    session: Session | None = None   # with `defer`: settle it once the answer is sent


class Gateway:
    def __init__(self, engine: Engine, template: ChatTemplate, parser: ToolCallParser, model_names: list[str],
                 defaults: Defaults = Defaults(), on_mismatch: str = "error", pin_sampling: bool = False):
        self.engine, self.template, self.parser = engine, template, parser
        self.model_names = list(model_names)
        self.defaults = defaults
        self.on_mismatch = on_mismatch
        self.pin_sampling = pin_sampling
        self.sessions: dict[str, Session] = {}
        self.stats = {"calls": 0, "errors": 0, "aborted": 0, "sampling_overridden": 0, "guesses_used": 0,
                      "guesses_wrong": 0}
        self.guesses = Guesses(template)

    # -- sessions ------------------------------------------------------------------------------------
    def open_session(self, group_id: str = "", sample_index: int = 0, info: dict[str, Any] | None = None) -> Session:
        sid = secrets.token_urlsafe(24)   # 192 random bits: an agent cannot guess another's session
        session = Session(sid, self.template, self.on_mismatch, group_id, sample_index, info)
        self.sessions[sid] = session
        return session

    def session(self, sid: str) -> Session:
        session = self.sessions.get(sid)
        if session is None or session.closed:
            raise APIError(404, f"Session '{sid[:8]}...' does not exist or is closed; open one with POST /sessions.",
                           code="session_not_found")
        session.settle()
        return session

    def close_session(self, sid: str) -> Trajectory:
        session = self.session(sid)
        del self.sessions[sid]
        return session.close()

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise APIError(404, f"The model '{model}' does not exist; this server serves {self.model_names}.",
                           "model", "model_not_found")

    # -- chat ----------------------------------------------------------------------------------------
    async def chat(self, req: ChatRequest, session: Session | None = None, defer: bool = False) -> Answer:
        """`defer`: the replies are committed to the session only at its next use (`Session.defer`); the caller
        settles it (`answer.session.settle()`) once the answer is sent, so the ledger's bookkeeping is not
        between the engine and the agent.

        With a guess (`_guess`), the engine starts on the guessed prompt first and the request is placed in
        its session while it samples; the sample is used only if the placed call's prompt and sampling equal
        the guess, token for token, else it is cancelled and the call samples again from its own prompt. The
        engine's time runs from submitting to its last completion, so checking longer than the engine took
        counts as the gateway's time."""
        guess = self._guess(req, session)
        start = time.perf_counter()
        tasks = self._submit(*guess[:2], 1) if guess is not None else None
        try:
            if tasks is not None:
                await asyncio.sleep(0)   # the engine takes the request before the check below runs
            call = self._begin_chat(req, session)
        except BaseException:
            _cancel(tasks or [])
            raise
        try:
            if guess is not None and (call.prompt != guess[0] or call.sampling != guess[1]):
                _cancel(tasks)
                self.guesses.forget(*guess[2])
                self.stats["guesses_wrong"] += 1
                tasks = None
            elif guess is not None:
                self.stats["guesses_used"] += 1
            if tasks is None:
                start = time.perf_counter()
                tasks = self._submit(call.prompt, call.sampling, req.sampling.n)
            completions, finished = await self._collect(tasks)
        except BaseException:
            self._undo(call)
            raise
        return self._end_chat(req, call, completions, finished - start, defer)

    def _guess(self, req: ChatRequest, session: Session | None) -> tuple[list[int], Sampling, Any] | None:
        """The prompt and sampling `_begin_chat` would give a one-choice request in a session, from
        `Session.guess`; None where there is none (or the guess cannot even be sampled)."""
        if session is None or session.closed or req.sampling.n != 1 or req.sampling.stream:
            return None
        self.check_model(req.model)
        guessed = session.guess(req.messages, req.tools, self.guesses)
        if guessed is None:
            return None
        prompt, forget = guessed
        try:
            prompt = prompt + self.forced_ids(req)
            sampling = self._sampling(req.sampling, len(prompt))
        except APIError:
            return None   # `_begin_chat` says why
        return prompt, self._seeded(sampling, session), forget

    async def chat_stream(self, req: ChatRequest, session: Session | None = None) -> AsyncIterator[str | Answer]:
        """One choice: its content as it is sampled (str deltas, `streaming.ContentStream`), then the Answer.
        Every check that can refuse the request runs before the first item. Leaving the iteration early (the
        client went away) aborts the engine request and undoes the call in its session."""
        call = self._begin_chat(req, session)
        content = ContentStream(self.template, call.parser, req.sampling.stop, call.forced)
        sampled = None
        try:
            async for item in resume.stream(self.engine, call.prompt, call.sampling):
                if isinstance(item, Delta):
                    delta = content.feed(item.token_ids)
                    if delta:
                        yield delta
                else:
                    sampled = item
            assert sampled is not None, "resume.stream ended without the request's completion"
            self._check_completions([sampled.completion])
        except EngineError as exc:
            self._undo(call)
            self.stats["errors"] += 1
            raise APIError(500, f"The engine failed: {exc}", kind="server_error", code="engine_error") from None
        except BaseException:
            self._undo(call)
            raise
        answer = self._end_chat(req, call, [sampled.completion])
        rest = content.finish(answer.replies[0])
        if rest:
            yield rest
        yield answer

    def _begin_chat(self, req: ChatRequest, session: Session | None) -> _Call:
        """Check the request, place it in its session (or a scratch one), and say what to sample."""
        self.check_model(req.model)
        self.stats["calls"] += 1
        parser = None if not req.tools or req.tool_choice == "none" else self.parser
        forced = self.forced_ids(req)
        if session is None:
            scratch = Session("unrecorded", self.template)
            prompt = scratch.begin(req.messages, req.tools).prompt_ids + forced
            return _Call(None, [], prompt, self._sampling(req.sampling, len(prompt)), parser, forced)
        if session.closed:
            raise APIError(404, "The session is closed.", code="session_not_found")
        first = session.begin(req.messages, req.tools)
        calls = [first] + [session.sibling(first) for _ in range(req.sampling.n - 1)]
        out = _Call(session, calls, first.prompt_ids, None, parser, forced)
        try:
            for c in calls:
                session.force(c, forced)
            out.prompt = first.prompt_ids
            sampling = self._sampling(req.sampling, len(out.prompt))
            sampling = self._seeded(sampling, session)
        except BaseException:
            self._undo(out)
            raise
        out.sampling = sampling
        return out

    def _undo(self, call: _Call) -> None:
        if call.session is not None:
            for c in reversed(call.calls):
                call.session.abort(c)
            self.stats["aborted"] += 1

    def _end_chat(self, req: ChatRequest, call: _Call, completions: list[Completion], engine_s: float = 0.0,
                  defer: bool = False) -> Answer:
        replies = [build_reply(self.template, call.parser, c.token_ids, c.logprobs, c.finish_reason,
                               req.sampling.stop, call.forced) for c in completions]
        if call.session is not None:
            for c, reply in zip(call.calls, replies):
                (call.session.defer if defer else call.session.commit)(c, reply)
        return Answer(new_id("chatcmpl-"), int(time.time()), req.model, replies, len(call.prompt), engine_s,
                      call.session if defer else None)

    def forced_ids(self, req: ChatRequest) -> list[int]:
        """The tokens of the call opening `tool_choice` forces ([] for auto, none, or a request without tools)."""
        choice = req.tool_choice
        if not req.tools or choice in ("auto", "none"):
            return []
        function = choice["function"]["name"] if isinstance(choice, dict) else None
        name = getattr(self.parser, "name", type(self.parser).__name__)
        what = f"tool_choice {function!r}" if function else "tool_choice 'required'"
        if self.template.prompt_opens_thinking:
            raise APIError(400, f"{what} cannot be enforced with this chat template: its generation prompt opens "
                                "<think>, so a forced call would sit inside the reasoning. Use tool_choice 'auto'.",
                           "tool_choice")
        try:
            opening = self.parser.forced_opening(function)
        except CannotForce as exc:
            instead = "'required' or 'auto'" if function else "'auto'"
            raise APIError(400, f"{what} cannot be enforced with the '{name}' tool parser: {exc}. Use tool_choice "
                                f"{instead}.", "tool_choice") from None
        return self.template.encode(opening)

    # -- text completions ----------------------------------------------------------------------------
    async def complete(self, req: CompletionRequest, session: Session | None = None) -> Answer:
        """Raw text in, text out (no chat template); in a session each call is recorded as its own segment."""
        self.check_model(req.model)
        self.stats["calls"] += 1
        prompt = list(req.prompt) if isinstance(req.prompt, list) else self.template.encode(req.prompt)
        if not prompt:
            raise APIError(400, "The prompt is empty after tokenization.", "prompt")
        vocab = len(self.template.tokenizer)
        if any(t >= vocab for t in prompt):
            raise APIError(400, f"Invalid 'prompt': token ids must be below the vocabulary size {vocab}.", "prompt")
        sampling = self._sampling(req.sampling, len(prompt))
        start = time.perf_counter()
        completions = await self._generate_all(prompt, sampling, req.sampling.n)
        engine_s = time.perf_counter() - start
        replies = []
        for c in completions:
            ids, lps, cut = cut_at_stop(self.template, c.token_ids, c.logprobs, req.sampling.stop)
            finish = "stop" if cut is not None else c.finish_reason
            text = cut if cut is not None else self.template.decode(ids)
            replies.append(Reply(ids, lps, finish, text, text))
            if session is not None:
                session.record_text(prompt, ids, lps, finish, text)
        return Answer(new_id("cmpl-"), int(time.time()), req.model, replies, len(prompt), engine_s)

    # -- sampling ------------------------------------------------------------------------------------
    def _sampling(self, s: Sampled, prompt_len: int) -> Sampling:
        d = self.defaults
        room = d.max_context - prompt_len
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {d.max_context} tokens. However, your "
                                f"messages resulted in {prompt_len} tokens. Please reduce the length of the messages.",
                           "messages", "context_length_exceeded")
        temperature, top_p = d.temperature, d.top_p
        if self.pin_sampling:
            if (s.temperature is not None and s.temperature != d.temperature) or \
                    (s.top_p is not None and s.top_p != d.top_p):
                self.stats["sampling_overridden"] += 1
        else:
            temperature = s.temperature if s.temperature is not None else d.temperature
            top_p = s.top_p if s.top_p is not None else d.top_p
        max_tokens = s.max_tokens if s.max_tokens is not None else d.max_tokens
        if d.max_tokens_cap is not None:
            max_tokens = min(max_tokens, d.max_tokens_cap)
        return Sampling(max_tokens=min(max_tokens, room), temperature=temperature, top_p=top_p, top_k=d.top_k,
                        stop_token_ids=tuple(self.template.stop_token_ids), seed=s.seed)

    def _seeded(self, sampling: Sampling, session: Session) -> Sampling:
        """Reproducible runs: without a request seed, the seed follows the row, the sample and the call."""
        if sampling.seed is not None:
            return sampling
        return sampling.with_(seed=request_seed(self.defaults.seed, session.group_id, session.sample_index,
                                                session.turn + len(session.branches)))

    async def _generate_all(self, prompt: list[int], sampling: Sampling, n: int) -> list[Completion]:
        return (await self._collect(self._submit(prompt, sampling, n)))[0]

    def _submit(self, prompt: list[int], sampling: Sampling, n: int) -> list[asyncio.Future]:
        """One engine request per choice, each saying when it finished (`_collect`)."""
        seeds = [sampling.seed if sampling.seed is None else sampling.seed + i for i in range(n)]
        return [asyncio.ensure_future(self._timed(prompt, sampling.with_(seed=seed))) for seed in seeds]

    async def _timed(self, prompt: list[int], sampling: Sampling) -> tuple[Completion, float]:
        return (await resume.generate(self.engine, prompt, sampling)).completion, time.perf_counter()

    async def _collect(self, tasks: list[asyncio.Future]) -> tuple[list[Completion], float]:
        """The completions, and when the last of them finished (perf_counter)."""
        try:
            done = await asyncio.gather(*tasks)
        except EngineError as exc:
            self.stats["errors"] += 1
            raise APIError(500, f"The engine failed: {exc}", kind="server_error", code="engine_error") from None
        finally:
            _cancel(tasks)   # cancelled from outside (client gone): abort every choice's engine request
        out = [completion for completion, _ in done]
        self._check_completions(out)
        return out, max(at for _, at in done)

    @staticmethod
    def _check_completions(completions: list[Completion]) -> None:
        if any(c.finish_reason == "abort" for c in completions):
            raise APIError(500, "The engine aborted the request.", kind="server_error", code="engine_error")


def _cancel(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()   # a thrown-away guess's engine error is nobody's: read, so it is not reported
