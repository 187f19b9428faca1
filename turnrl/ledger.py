"""The trajectory ledger: the one record every stage passes along.

A `Trajectory` is a conversation between the policy, its tools and a (simulated) user. Its tokens live in
one or more `Segment`s; a segment is one training sample, the exact token stream the policy was
conditioned on. Normally a trajectory has one segment; the chat layer starts a new one only when a chat
template is not append-only and the user asked for `on_mismatch: split`.

For every token the ledger keeps its id, its source (who wrote it), the turn it belongs to, the logprob the
engine sampled it with (policy tokens only) and the loss mask. Invariants (`check`):
- all per-token lists have the same length;
- the loss mask is 1 only on policy tokens, and on all of them unless the trajectory is masked out;
- logprobs are 0.0 on every non-policy token.
`to_batch` turns trajectories into the padded tensors the trainer consumes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

import torch


class Source(IntEnum):
    PROMPT = 0     # the rendered first prompt (system, user, tool schemas)
    POLICY = 1     # sampled by the policy: the only tokens that are trained
    TOOL = 2       # tool results
    USER = 3       # simulated user / environment replies
    TEMPLATE = 4   # chat-template glue the model did not write (turn boundaries, generation prompts)


TERMINATIONS = ("eos", "max_assistant_turns", "max_user_turns", "token_budget", "context_limit",
                "interaction_done", "error")


class LedgerError(AssertionError):
    """An internal ledger invariant was broken (a bug, never user input)."""


@dataclass
class Segment:
    token_ids: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def append(self, ids: list[int], source: Source, turn: int, logprobs: list[float] | None = None) -> None:
        if source == Source.POLICY:
            if logprobs is None or len(logprobs) != len(ids):
                raise LedgerError("policy tokens need one logprob each")
        elif logprobs is not None:
            raise LedgerError("only policy tokens carry logprobs")
        n = len(ids)
        self.token_ids.extend(map(int, ids))
        self.sources.extend([int(source)] * n)
        self.turns.extend([turn] * n)
        self.logprobs.extend(map(float, logprobs) if logprobs is not None else [0.0] * n)
        self.loss_mask.extend([1 if source == Source.POLICY else 0] * n)

    def count(self, source: Source) -> int:
        return sum(1 for s in self.sources if s == source)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] | None
    raw: str
    id: str = ""
    error: str | None = None     # parse error: malformed JSON, unknown tool, bad arguments


@dataclass
class ToolResult:
    name: str
    text: str
    call_id: str = ""
    reward: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    blame: str | None = None     # "policy" (bad call) or "environment" (tool crashed / timed out)
    truncated: bool = False
    seconds: float = 0.0


@dataclass
class Turn:
    index: int
    segment: int
    start: int                   # policy token span [start, end) inside the segment
    end: int
    finish_reason: str           # stop | length | abort
    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_results: list[ToolResult] = field(default_factory=list)
    user_reply: str | None = None
    tool_reward: float = 0.0     # step rewards the tools gave this turn
    user_reward: float = 0.0     # the interaction's reward for this turn
    reward: float = 0.0          # the enabled step rewards of this turn (set by the reward stage)
    seconds: float = 0.0


@dataclass
class ErrorRecord:
    kind: str                    # tool_parse | tool_error | tool_timeout | interaction | engine | chat | reward ...
    message: str
    turn: int = -1
    blame: str = "environment"   # "policy" errors are learnable and stay in the loss; environment ones mask


@dataclass
class Trajectory:
    group_id: str
    sample_index: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=lambda: [Segment()])
    turns: list[Turn] = field(default_factory=list)
    termination: str = ""
    errors: list[ErrorRecord] = field(default_factory=list)
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    masked: bool = False         # excluded from the loss (environment failure)
    mask_reason: str = ""
    parity: str = ""             # exact | token_drift | mismatch | split
    policy_version: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)   # row fields: data_source, ground_truth, index...

    @property
    def segment(self) -> Segment:
        return self.segments[-1]

    def n_tokens(self, source: Source | None = None) -> int:
        if source is None:
            return sum(len(s) for s in self.segments)
        return sum(s.count(source) for s in self.segments)

    def add_error(self, kind: str, message: str, turn: int = -1, blame: str = "environment") -> None:
        self.errors.append(ErrorRecord(kind, message, turn, blame))
        if blame == "environment":
            self.mask(f"{kind}: {message}")

    def mask(self, reason: str) -> None:
        if not self.masked:
            self.masked, self.mask_reason = True, reason

    def check(self) -> None:
        """Raise LedgerError if an invariant is broken."""
        for k, seg in enumerate(self.segments):
            n = len(seg.token_ids)
            if not (len(seg.sources) == len(seg.turns) == len(seg.logprobs) == len(seg.loss_mask) == n):
                raise LedgerError(f"segment {k}: per-token lists differ in length")
            for i in range(n):
                policy = seg.sources[i] == Source.POLICY
                if seg.loss_mask[i] and not policy:
                    raise LedgerError(f"segment {k} token {i}: loss mask on a non-policy token")
                if policy and not seg.loss_mask[i] and not self.masked:
                    raise LedgerError(f"segment {k} token {i}: policy token outside the loss mask")
                if not policy and seg.logprobs[i] != 0.0:
                    raise LedgerError(f"segment {k} token {i}: logprob on a non-policy token")
            if any(b < a for a, b in zip(seg.turns, seg.turns[1:])):
                raise LedgerError(f"segment {k}: turn indices go backwards")
        for turn in self.turns:
            seg = self.segments[turn.segment]
            if not 0 <= turn.start <= turn.end <= len(seg):
                raise LedgerError(f"turn {turn.index}: span out of range")
            if any(seg.sources[i] != Source.POLICY for i in range(turn.start, turn.end)):
                raise LedgerError(f"turn {turn.index}: span holds non-policy tokens")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Trajectory":
        data = dict(data)
        data["segments"] = [Segment(**s) for s in data.get("segments", [])]
        turns = []
        for t in data.get("turns", []):
            t = dict(t)
            t["tool_calls"] = [ToolCall(**c) for c in t.get("tool_calls", [])]
            t["tool_results"] = [ToolResult(**r) for r in t.get("tool_results", [])]
            turns.append(Turn(**t))
        data["turns"] = turns
        data["errors"] = [ErrorRecord(**e) for e in data.get("errors", [])]
        return cls(**data)


class Batch(NamedTuple):
    """Right-padded training tensors, one row per segment. Token i's logprob sits at column i."""
    input_ids: torch.Tensor        # [B, T] long
    attention_mask: torch.Tensor   # [B, T] long, 1 on real tokens
    position_ids: torch.Tensor     # [B, T] long
    loss_mask: torch.Tensor        # [B, T] float, 1 on trained policy tokens
    old_logprobs: torch.Tensor     # [B, T] float, engine logprobs of the sampled tokens
    token_rewards: torch.Tensor    # [B, T] float, turn rewards on each turn's last policy token
    turn_ids: torch.Tensor         # [B, T] long
    rewards: torch.Tensor          # [B] float, trajectory reward
    group_ids: torch.Tensor        # [B] long, the prompt group (GRPO)
    traj_index: torch.Tensor       # [B] long, index into the trajectory list


def to_batch(trajectories: list[Trajectory], turn_rewards: bool = False, pad_id: int = 0) -> Batch:
    """Pad all segments of `trajectories` into a `Batch`.

    Rewards: the trajectory reward (the total, step rewards included) sits on the last policy token of its
    last segment that has one. With `turn_rewards`, each turn's step reward sits on that turn's last policy
    token instead and only the rest of the total (the outcome part) on the last one, so the rows still sum to
    the total.
    Masked trajectories keep their rows, with a zero loss mask.
    """
    rows = [(ti, si) for ti, t in enumerate(trajectories) for si in range(len(t.segments))]
    width = max((len(trajectories[ti].segments[si]) for ti, si in rows), default=0)
    B = len(rows)
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    attention = torch.zeros((B, width), dtype=torch.long)
    loss_mask = torch.zeros((B, width))
    old_lp = torch.zeros((B, width))
    token_rewards = torch.zeros((B, width))
    turn_ids = torch.zeros((B, width), dtype=torch.long)
    group_keys: dict[str, int] = {}
    group_ids = torch.zeros(B, dtype=torch.long)
    traj_index = torch.zeros(B, dtype=torch.long)
    rewards = torch.zeros(B)
    # The outcome goes on the last policy token of the trajectory: in its last segment that has one (a split
    # can leave a final segment that holds only the re-rendered history, e.g. when the budget ran out).
    outcome_segment = {ti: max((si for si, seg in enumerate(t.segments) if _last_policy_index(seg) >= 0),
                               default=len(t.segments) - 1) for ti, t in enumerate(trajectories)}
    for row, (ti, si) in enumerate(rows):
        traj, seg = trajectories[ti], trajectories[ti].segments[si]
        n = len(seg)
        input_ids[row, :n] = torch.tensor(seg.token_ids, dtype=torch.long)
        attention[row, :n] = 1
        if not traj.masked:
            loss_mask[row, :n] = torch.tensor(seg.loss_mask, dtype=torch.float)
        old_lp[row, :n] = torch.tensor(seg.logprobs)
        turn_ids[row, :n] = torch.tensor(seg.turns, dtype=torch.long)
        group_ids[row] = group_keys.setdefault(traj.group_id, len(group_keys))
        traj_index[row] = ti
        rewards[row] = traj.reward
        outcome = traj.reward
        if turn_rewards:
            for t in traj.turns:
                if t.segment == si and t.end > t.start:
                    token_rewards[row, t.end - 1] += t.reward
            outcome -= sum(t.reward for t in traj.turns if t.end > t.start)
        if si == outcome_segment[ti]:
            last = _last_policy_index(seg)
            if last >= 0:
                token_rewards[row, last] += outcome
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0) * attention
    return Batch(input_ids, attention, positions, loss_mask, old_lp, token_rewards, turn_ids, rewards,
                 group_ids, traj_index)


def _last_policy_index(seg: Segment) -> int:
    for i in range(len(seg.sources) - 1, -1, -1):
        if seg.sources[i] == Source.POLICY:
            return i
    return -1
