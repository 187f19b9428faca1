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
`turnrl.train.batching.to_rows` turns trajectories into the padded tensors the trainer consumes.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any, ClassVar



class Source(IntEnum):
    PROMPT = 0     # the rendered first prompt (system, user, tool schemas)
    POLICY = 1     # sampled by the policy: the only tokens that are trained
    TOOL = 2       # tool results
    USER = 3       # simulated user / environment replies
    TEMPLATE = 4   # chat-template glue the model did not write (turn boundaries, generation prompts)


class Termination(StrEnum):
    """Why a trajectory stopped ("" while it runs)."""
    UNSET = ""
    EOS = "eos"
    MAX_ASSISTANT_TURNS = "max_assistant_turns"
    MAX_USER_TURNS = "max_user_turns"
    TOKEN_BUDGET = "token_budget"
    CONTEXT_LIMIT = "context_limit"
    INTERACTION_DONE = "interaction_done"
    ERROR = "error"


class Parity(StrEnum):
    """How the ledger compares with a full re-render of the conversation ("" before the check)."""
    UNCHECKED = ""
    EXACT = "exact"              # the same token ids
    TOKEN_DRIFT = "token_drift"  # the same text, other token ids (the policy sampled a non-canonical split)
    MISMATCH = "mismatch"        # other text: the template is not append-only
    SPLIT = "split"              # a new segment was started at a mismatch (`on_mismatch: split`)


class Blame(StrEnum):
    POLICY = "policy"            # a learnable mistake (bad call JSON, unknown tool): stays in the loss
    ENVIRONMENT = "environment"  # a tool crash, a timeout, a judge outage: masks the trajectory


class ErrorKind(StrEnum):
    TOOL_PARSE = "tool_parse"          # the policy's call did not parse or names no tool
    TOOL_ERROR = "tool_error"          # the tool raised or returned something unusable
    TOOL_TIMEOUT = "tool_timeout"
    TOOL_CREATE = "tool_create"        # create() failed for the row
    TOOL_LIFECYCLE = "tool_lifecycle"  # reward() / release() failed
    INTERACTION = "interaction"        # the simulated user failed to start, answer or finish
    ENGINE = "engine"
    CHAT = "chat"                      # the template could not render the conversation exactly
    REWARD = "reward"                  # a reward function raised
    JUDGE = "judge"                    # an LLM judge failed
    AGENT = "agent"                    # an external agent behind the gateway misbehaved (no model calls ...)
    INTERNAL = "internal"              # a turnrl bug (a ledger invariant broke, an exception escaped)


TERMINATIONS = tuple(t.value for t in Termination if t.value)


def _member(vocabulary: type[StrEnum], value: Any, what: str) -> StrEnum:
    """`value` as a member of `vocabulary`; a ValueError naming the allowed values otherwise."""
    try:
        return vocabulary(value)
    except ValueError:
        allowed = ", ".join(repr(v.value) for v in vocabulary)
        raise ValueError(f"{what} {value!r} is not one of {allowed} (turnrl.ledger.{vocabulary.__name__}; "
                         "add a member there for a new kind)") from None


class _Checked:
    """Fields named in `_VOCABULARIES` only take members of their vocabulary, at construction and after."""
    _VOCABULARIES: ClassVar[dict[str, type[StrEnum]]] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        vocabulary = self._VOCABULARIES.get(name)
        if vocabulary is not None and value is not None:
            value = _member(vocabulary, value, f"{type(self).__name__}.{name}")
        object.__setattr__(self, name, value)


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
class ToolResult(_Checked):
    _VOCABULARIES = {"blame": Blame, "kind": ErrorKind}
    name: str
    text: str
    call_id: str = ""
    reward: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    blame: Blame | None = None   # "policy" (bad call) or "environment" (tool crashed / timed out)
    kind: ErrorKind | None = None   # with `error`: tool_parse, tool_error or tool_timeout
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
    versions: list[tuple[int, int]] = field(default_factory=list)   # (offset into the span, weight version)
    #                              per run of tokens one version sampled; [] = the trajectory's policy_version

    def token_versions(self, default: int) -> list[int]:
        """The weight version that sampled each of the turn's policy tokens."""
        out: list[int] = []
        n = self.end - self.start
        for k, (offset, version) in enumerate(self.versions):
            stop = self.versions[k + 1][0] if k + 1 < len(self.versions) else n
            out += [default if version is None else int(version)] * (stop - offset)
        return out if self.versions else [default] * n


@dataclass
class ErrorRecord(_Checked):
    _VOCABULARIES = {"kind": ErrorKind, "blame": Blame}
    kind: ErrorKind
    message: str
    turn: int = -1
    blame: Blame = Blame.ENVIRONMENT   # "policy" errors are learnable and stay in the loss; environment ones mask


@dataclass
class Trajectory(_Checked):
    _VOCABULARIES = {"termination": Termination, "parity": Parity}
    group_id: str
    sample_index: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=lambda: [Segment()])
    turns: list[Turn] = field(default_factory=list)
    termination: Termination = Termination.UNSET
    errors: list[ErrorRecord] = field(default_factory=list)
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    masked: bool = False         # excluded from the loss (environment failure)
    mask_reason: str = ""
    parity: Parity = Parity.UNCHECKED
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

    def add_error(self, kind: ErrorKind | str, message: str, turn: int = -1,
                  blame: Blame | str = Blame.ENVIRONMENT) -> None:
        record = ErrorRecord(kind, message, turn, blame)
        self.errors.append(record)
        if record.blame == Blame.ENVIRONMENT:
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
            policy = Source.POLICY
            for i, (source, mask, logprob) in enumerate(zip(seg.sources, seg.loss_mask, seg.logprobs)):
                if source == policy:
                    if not mask and not self.masked:
                        raise LedgerError(f"segment {k} token {i}: policy token outside the loss mask")
                elif mask:
                    raise LedgerError(f"segment {k} token {i}: loss mask on a non-policy token")
                elif logprob != 0.0:
                    raise LedgerError(f"segment {k} token {i}: logprob on a non-policy token")
            if any(b < a for a, b in zip(seg.turns, seg.turns[1:])):
                raise LedgerError(f"segment {k}: turn indices go backwards")
        for turn in self.turns:
            seg = self.segments[turn.segment]
            if not 0 <= turn.start <= turn.end <= len(seg):
                raise LedgerError(f"turn {turn.index}: span out of range")
            if any(source != Source.POLICY for source in seg.sources[turn.start:turn.end]):
                raise LedgerError(f"turn {turn.index}: span holds non-policy tokens")

    def to_dict(self) -> dict[str, Any]:
        """`dataclasses.asdict(self)`, equal to it, without its per-element recursion and deep copies of every
        int in the token lists (several ms for a long trajectory, on every close and every saved record)."""
        return _plain(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Trajectory":
        data = dict(data)
        data["segments"] = [Segment(**s) for s in data.get("segments", [])]
        turns = []
        for t in data.get("turns", []):
            t = dict(t)
            t["tool_calls"] = [ToolCall(**c) for c in t.get("tool_calls", [])]
            t["tool_results"] = [ToolResult(**r) for r in t.get("tool_results", [])]
            t["versions"] = [tuple(v) for v in t.get("versions", [])]   # JSON has made the pairs lists
            turns.append(Turn(**t))
        data["turns"] = turns
        data["errors"] = [ErrorRecord(**e) for e in data.get("errors", [])]
        return cls(**data)


_ATOMS = (int, float, str, bool, type(None))


def _plain(obj: Any) -> Any:
    """What `dataclasses.asdict` makes of a ledger value: dataclasses as dicts, lists, tuples and dicts copied,
    leaves as they are (ints, floats, strings, enums: immutable, so a deep copy would return them anyway);
    anything else deep-copied, as asdict does."""
    if isinstance(obj, _ATOMS):
        return obj
    if isinstance(obj, list):
        return [v if type(v) in _ATOMS else _plain(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {_plain(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        items = [_plain(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)
