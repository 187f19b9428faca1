"""The agent loop: the one loop every engine, task and algorithm goes through.

    prompt -> generate -> parse tool calls -> run tools ------------------> append tool results -> generate
                                      \\-> (no calls) interaction replies -> append user turn   -> generate
                                      \\-> (no calls, no interaction) stop

Single-turn is the case with neither tools nor an interaction. Limits are checked before every step:
`max_assistant_turns`, `max_user_turns` (tool and user turns together, as in verl), a total response-token
budget (policy and environment tokens after the prompt), and the context length (at most the engine's
`max_model_len`); a turn's `max_tokens` never exceeds the budget or the context left, and a tool result or
user reply that does not fit is cut with the tool-output marker or ends the trajectory (rollout/fit.py), so no
turn overshoots. Every stop has an explicit reason.
An interaction sees every assistant answer, the last one too, so its reward can depend on the final answer.

Failures never escape: engine errors, tool crashes, interaction crashes and template mismatches are
recorded on the trajectory (environment failures mask it out of the loss) and the loop ends cleanly, so the
rest of the batch goes on.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

from turnrl.chat.batch_encode import BatchEncoder
from turnrl.chat.parsers import ToolCallParser
from turnrl.chat.session import ChatMismatchError, ChatSession
from turnrl.chat.templates import ChatTemplate
from turnrl.data.rows import Task
from turnrl.engines.base import Engine, EngineError, Sampling
from turnrl.env.interactions import as_reply
from turnrl.env.tools import ToolSession, as_text, call, finite_reward
from turnrl.ledger import LedgerError, ToolResult, Trajectory, Turn
from turnrl.engines import resume
from turnrl.rollout.fit import EnvTurn, fit_turn, truncate_tokens


@dataclass(frozen=True)
class Limits:
    max_assistant_turns: int = 4
    max_user_turns: int = 4
    max_response_tokens: int = 1024
    max_context_tokens: int = 4096


@dataclass
class Environment:
    """How each trajectory gets its own tools and interaction."""
    tool_factories: dict[str, Callable[[], Any]] = field(default_factory=dict)
    interaction_factories: dict[str, Callable[[], Any]] = field(default_factory=dict)
    tool_timeout_s: float = 10.0
    max_parallel_calls: int = 4
    max_tool_response_tokens: int = 256
    truncate_side: str = "middle"
    tool_errors_to_model: bool = True
    interaction_timeout_s: float = 60.0
    default_tools: list[str] | None = None   # tools of a row that names none; None: every factory


def rollout_seed(seed: int, step: int) -> int:
    """The agent loop's base seed for step `step` (or policy version) of a run seeded `seed`."""
    return seed * 1_000_003 + step


def session_key(seed: int, uid: str, sample: int) -> str:
    """The trajectory's name in its requests' `Sampling.session` (a router pins a session to one replica)."""
    return f"{seed}:{uid}/{sample}"


def openai_tool_call(tc: Any, k: int) -> dict[str, Any]:
    """A parsed tool call as an OpenAI chat message's `tool_calls` entry (arguments as a JSON string; the raw
    text when it did not parse)."""
    args = json.dumps(tc.arguments) if tc.arguments is not None and not tc.error else tc.raw
    return {"id": tc.id or f"call_{k}", "type": "function", "function": {"name": tc.name, "arguments": args}}


def request_seed(base: int, uid: str, sample: int, turn: int) -> int:
    return zlib.crc32(f"{base}/{uid}/{sample}/{turn}".encode()) & 0x7FFFFFFF


def record_cut(turn: Turn, fitted: EnvTurn) -> None:
    """The turn's records show what the model saw: the cut texts."""
    if turn.tool_results:
        for result, text in zip(turn.tool_results, fitted.texts):
            if result.text != text:
                result.text, result.truncated = text, True
    else:
        turn.user_reply = fitted.texts[0]


class AgentLoop:
    def __init__(self, engine: Engine, template: ChatTemplate, parser: ToolCallParser, env: Environment,
                 limits: Limits, sampling: Sampling, on_mismatch: str = "error", seed: int = 0,
                 policy_version: int = 0):
        self.engine = engine
        self.template = template
        self.parser = parser
        self.env = env
        self.limits = limits
        self.sampling = sampling.with_(stop_token_ids=tuple(sampling.stop_token_ids or template.stop_token_ids))
        self.on_mismatch = on_mismatch
        self.seed = seed
        self.policy_version = policy_version
        # The last turn is closed by the template's suffix when the trajectory ends (finish): room is kept for it,
        # so that the finished trajectory, not only its last turn, is within max_context_tokens.
        self.closing = len(template.encode(template.assistant_suffix)) if template.assistant_suffix else 0
        self.encoder = BatchEncoder(template)

    def _tools_for(self, task: Task) -> dict[str, Any]:
        if task.tools is not None:
            names = task.tools
        else:
            names = list(self.env.tool_factories) if self.env.default_tools is None else self.env.default_tools
        missing = [n for n in names if n not in self.env.tool_factories]
        if missing:
            raise ValueError(f"task {task.uid} asks for unknown tool(s) {missing}; "
                             f"configured: {sorted(self.env.tool_factories)}")
        return {n: self.env.tool_factories[n]() for n in names}

    async def run(self, task: Task, sample_index: int = 0) -> Trajectory:
        traj = Trajectory(group_id=task.uid, sample_index=sample_index, messages=[], info=dict(task.info),
                          policy_version=self.policy_version)
        start = time.perf_counter()
        tools: ToolSession | None = None
        interaction = None
        try:
            tools = ToolSession(self._tools_for(task), task.tools_kwargs, self.env.tool_timeout_s,
                                self.env.max_parallel_calls,
                                lambda text: truncate_tokens(self.template, text, self.env.max_tool_response_tokens,
                                                             self.env.truncate_side))
            session = ChatSession(self.template, task.messages, tools.schemas, traj, self.on_mismatch)
            await tools.create()
            for name, message in tools.create_errors.items():
                traj.add_error("tool_create", f"{name}: {message}")
            if task.interaction is not None:
                interaction = await self._start_interaction(task, traj)
            await self._converse(task, traj, session, tools, interaction)
            full = session.close()   # parity: the full re-render's tokens, batched off the event loop
            session.judge(full, await self.encoder.encode(full))
            if traj.parity == "mismatch" and self.on_mismatch == "error":
                traj.add_error("chat", f"ledger differs from a full re-render: {traj.metrics.get('parity_detail')}")
        except ChatMismatchError as exc:
            traj.termination = "error"
            traj.add_error("chat", str(exc))
        except Exception as exc:  # noqa: BLE001 - one broken trajectory never stops the batch
            traj.termination = "error"
            traj.add_error("internal", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}")
        finally:
            await self._finish(traj, tools, interaction)
        try:
            traj.check()
        except LedgerError as exc:  # a turnrl bug: this trajectory leaves the loss, the batch goes on
            traj.add_error("internal", f"ledger invariant broken: {exc}")
        traj.timings["total_s"] = time.perf_counter() - start
        return traj

    async def _start_interaction(self, task: Task, traj: Trajectory) -> Any:
        kwargs = dict(task.interaction or {})
        name = kwargs.pop("name")
        factory = self.env.interaction_factories.get(name)
        if factory is None:
            raise ValueError(f"task {task.uid} asks for unknown interaction '{name}'; "
                             f"configured: {sorted(self.env.interaction_factories)}")
        interaction = factory()
        try:
            await asyncio.wait_for(call(interaction.start, **kwargs), self.env.interaction_timeout_s)
        except Exception as exc:  # noqa: BLE001
            traj.termination = "error"
            traj.add_error("interaction", f"start failed: {type(exc).__name__}: {exc}")
            return None
        return interaction

    async def _converse(self, task: Task, traj: Trajectory, session: ChatSession, tools: ToolSession,
                        interaction: Any) -> None:
        if traj.masked:
            return
        limits = self.limits
        prompt_len = len(session.context_ids)
        env_turns = 0
        turn_index = 0
        while True:
            # After a split the current segment re-renders the whole conversation: it alone holds what was used.
            used = len(session.context_ids) - prompt_len
            budget = limits.max_response_tokens - used
            context = limits.max_context_tokens - self.closing - len(session.context_ids)
            if budget <= 0 or context <= 0:
                traj.termination = "token_budget" if budget <= 0 else "context_limit"
                return
            max_tokens = min(self.sampling.max_tokens, budget, context)
            sampling = self.sampling.with_(max_tokens=max_tokens,
                                           seed=request_seed(self.seed, task.uid, traj.sample_index, turn_index),
                                           session=session_key(self.seed, task.uid, traj.sample_index))
            t0 = time.perf_counter()
            try:
                sampled = await resume.generate(self.engine, list(session.context_ids), sampling)
            except EngineError as exc:
                traj.termination = "error"
                traj.add_error("engine", str(exc), turn_index)
                return
            traj.timings["generate_s"] = traj.timings.get("generate_s", 0.0) + time.perf_counter() - t0
            completion = sampled.completion
            if sampled.interruptions:
                traj.metrics["interruptions"] = traj.metrics.get("interruptions", 0) + sampled.interruptions
            if not all(math.isfinite(x) for x in completion.logprobs):
                traj.termination = "error"
                traj.add_error("engine", "the engine returned non-finite logprobs", turn_index)
                return
            turn = session.add_assistant(completion.token_ids, completion.logprobs, completion.finish_reason,
                                         turn_index)
            if all(v is not None for _, v in sampled.versions):
                turn.versions = [(offset, int(v)) for offset, v in sampled.versions]
            if completion.finish_reason == "abort":
                traj.termination = "error"
                traj.add_error("engine", "request aborted", turn_index)
                return
            out_of_room = None  # the turn used up the budget or the context: nothing more can follow it
            if completion.finish_reason == "length" and max_tokens in (budget, context):
                out_of_room = "token_budget" if max_tokens == budget else "context_limit"
            calls = self.parser.parse(turn.text)
            if not calls and interaction is None:
                traj.termination = out_of_room or ("eos" if completion.finish_reason == "stop" else "token_budget")
                return
            stop = out_of_room
            if stop is None and turn_index + 1 >= limits.max_assistant_turns:
                stop = "max_assistant_turns"
            if stop is None and env_turns >= limits.max_user_turns:
                stop = "max_user_turns"
            if calls and not getattr(interaction, "takes_tool_calls", False):
                if stop:
                    traj.termination = stop
                    return
                env_turn = await self._run_tools(calls, turn, traj, tools)
            else:
                # The interaction judges every answer, the last one too (its reward may depend on it); its
                # reply is appended only when the conversation goes on. One that takes tool calls (an
                # environment that runs its own tools, e.g. verifiers') answers those turns too.
                env_turn = await self._ask_user(interaction, turn, traj, calls)
                if env_turn is not None and stop:
                    traj.termination = stop
                    return
            if env_turn is None:
                return
            max_context = limits.max_context_tokens - self.closing
            fitted = fit_turn(session, env_turn, min(max_context, limits.max_response_tokens + prompt_len),
                              self.env.truncate_side)
            if fitted is None:
                over_context = max_context <= limits.max_response_tokens + prompt_len
                traj.termination = "context_limit" if over_context else "token_budget"
                return
            if fitted.cut:
                record_cut(turn, fitted)
            env_turns += 1
            turn_index += 1
            session.add_environment(fitted.messages(), turn_index - 1)

    async def _run_tools(self, calls: list[Any], turn: Turn, traj: Trajectory, tools: ToolSession
                         ) -> EnvTurn | None:
        t0 = time.perf_counter()
        turn.tool_calls = calls
        results = await tools.execute_all(calls)
        turn.tool_results = results
        traj.timings["tools_s"] = traj.timings.get("tools_s", 0.0) + time.perf_counter() - t0
        for r in results:
            if r.reward is not None:
                turn.tool_reward += r.reward
            if r.error:
                traj.add_error(r.kind or "tool_error", r.error, turn.index, blame=r.blame or "environment")
        if any(r.error for r in results) and not self.env.tool_errors_to_model:
            traj.termination = "error"
            return None
        return EnvTurn([r.text for r in results],
                       lambda texts: [self.template.tool_message(r.name or "unknown", text, r.call_id)
                                      for r, text in zip(results, texts)])

    async def _ask_user(self, interaction: Any, turn: Turn, traj: Trajectory, calls: list[Any] = ()
                        ) -> EnvTurn | None:
        t0 = time.perf_counter()
        messages = [dict(m) for m in traj.messages]
        if calls:
            turn.tool_calls = list(calls)
            messages[-1]["tool_calls"] = [openai_tool_call(c, k) for k, c in enumerate(calls)]
            for c in calls:
                if c.error:
                    traj.add_error("tool_parse", c.error, turn.index, blame="policy")
        try:
            reply = as_reply(await asyncio.wait_for(call(interaction.respond, messages),
                                                    self.env.interaction_timeout_s))
            if not isinstance(reply.text, str):  # a Reply built by hand can hold anything
                raise TypeError(f"the reply's text must be a string, got {type(reply.text).__name__}")
            reply.text = as_text(reply.text)
            reply.reward = finite_reward(reply.reward, "the reply's reward")
        except Exception as exc:  # noqa: BLE001 - a broken simulated user is data
            traj.termination = "error"
            what = "timed out" if isinstance(exc, asyncio.TimeoutError) else f"{type(exc).__name__}: {exc}"
            traj.add_error("interaction", f"respond failed: {what}", turn.index)
            return None
        finally:
            traj.timings["interaction_s"] = traj.timings.get("interaction_s", 0.0) + time.perf_counter() - t0
        turn.user_reward += reply.reward
        turn.user_reply = reply.text
        if reply.info:
            traj.metrics.setdefault("interaction_info", []).append(reply.info)
        for message in reply.errors:  # failures behind the reply (a tool of the environment raised): masked
            traj.add_error("tool_error", message, turn.index)
        if reply.done:
            traj.termination = "interaction_done"
            return None
        if reply.messages is None:
            return EnvTurn([reply.text], lambda texts: [{"role": "user", "content": texts[0]}])
        said = [dict(m) for m in reply.messages]
        for m in said:
            if m.get("role") == "tool":
                turn.tool_results.append(ToolResult(str(m.get("name") or ""), as_text(m.get("content") or ""),
                                                    str(m.get("tool_call_id") or "")))

        def messages(texts: list[str]) -> list[dict[str, Any]]:
            return [self.template.tool_message(str(m.get("name") or "tool"), text, str(m.get("tool_call_id") or ""))
                    if m.get("role") == "tool" else {"role": "user", "content": text} for m, text in zip(said, texts)]
        return EnvTurn([as_text(m.get("content") or "") for m in said], messages)

    async def _finish(self, traj: Trajectory, tools: ToolSession | None, interaction: Any) -> None:
        """Final rewards and release, whatever happened before."""
        if tools is not None:
            rewards, errors = await tools.rewards()
            for name, value in rewards.items():
                traj.reward_parts[f"tool:{name}"] = value
            for message in errors + await tools.release():
                traj.add_error("tool_lifecycle", message)
        if interaction is not None:
            try:
                final = await asyncio.wait_for(call(interaction.finish), self.env.interaction_timeout_s)
                if isinstance(final, dict):  # {"score": total, **parts}, as reward functions may return
                    traj.metrics.update({f"interaction/{k}": float(v) for k, v in final.items() if k != "score"})
                    final = final["score"]
                if final is not None:
                    traj.reward_parts["interaction"] = finite_reward(final, "the final reward")
            except Exception as exc:  # noqa: BLE001
                traj.add_error("interaction", f"finish failed: {type(exc).__name__}: {exc}")
        if not traj.termination:
            traj.termination = "error"
