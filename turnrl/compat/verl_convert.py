"""The types the verl key table is made of, and the value helpers its converters share.

A converter takes (value, ctx) and returns `Out` (turnrl keys to set, a note, or not applicable for this
value with the reason), or raises `Refused` for a value turnrl cannot honour. `Ctx` shows the whole command
line, with verl's defaults for what it leaves out, so conversions can combine keys. A `Rule` ties a verl key
(or a pattern of keys) to its converter; `verl_keys.RULES` is the table.

The converters are grouped by what they configure: `verl_convert_rollout` (data files and prompts, the chat
template, the rollout engine and its sampling, agent loops and tools) and `verl_convert_trainer` (the
algorithm and its KL, batching, steps and warmup, the critic, scale-out, checkpoints, logging and rewards).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

AR = "actor_rollout_ref"


class Refused(ValueError):
    """A verl value turnrl cannot honour; the message says why and what to do."""


@dataclass
class Out:
    assign: dict[str, Any] = field(default_factory=dict)   # turnrl dotted key -> value
    note: str = ""
    applicable: bool = True     # False: not applicable for this value (the note says why)


def na(reason: str) -> Out:
    return Out({}, reason, applicable=False)


Convert = Callable[[Any, "Ctx"], Out]


@dataclass(frozen=True)
class Rule:
    pattern: str                # a verl key; `*` matches one dotted part, a final `**` any rest
    target: str                 # the turnrl side, as the key table shows it ('' when not applicable)
    note: str = ""              # the reason (not applicable) or what differs
    convert: Convert | None = None   # None: always not applicable


class Ctx:
    """The whole verl command line as converters see it: given values, else verl's defaults."""

    def __init__(self, given: dict[str, Any], defaults: dict[str, Any] | None = None):
        self.given = given
        self.defaults = defaults or {}
        self.key = ""           # the key being converted (for rules whose pattern has a `*`)

    def has(self, key: str) -> bool:
        return key in self.given

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.given:
            return self.given[key]
        if key in self.defaults:
            value = self.defaults[key]
            return value(self) if callable(value) else value
        return default

    def under(self, prefix: str) -> dict[str, Any]:
        """`prefix.a=1 prefix.b=2` (or `prefix={a: 1, b: 2}`) as {a: 1, b: 2}."""
        out = dict(self.given.get(prefix) or {}) if isinstance(self.given.get(prefix), dict) else {}
        for key, value in self.given.items():
            if key.startswith(prefix + "."):
                out[key[len(prefix) + 1:]] = value
        return out


# -- value helpers -------------------------------------------------------------------------------------
def as_int(value: Any, what: str = "an integer") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise Refused(f"must be {what}, got {value!r}")
    return int(value)


def as_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Refused(f"must be a number, got {value!r}")
    return float(value)


def as_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise Refused(f"must be true or false, got {value!r}")
    return value


def is_empty(value: Any) -> bool:
    return value is None or value == "" or value == [] or value == {}


def one_of(value: Any, table: dict[Any, Any], what: str) -> Any:
    if value not in table:
        raise Refused(f"{what} {value!r} is not supported here; supported: {', '.join(map(str, table))}")
    return table[value]


def as_file(value: Any, what: str) -> Path | None:
    """An existing file named by a path (or a one-element list of paths); None when empty."""
    if isinstance(value, list):
        if len(value) > 1:
            raise Refused(f"{len(value)} {what} files given; turnrl reads one file: concatenate them "
                          "(pyarrow.concat_tables) into one parquet")
        value = value[0] if value else None
    if is_empty(value):
        return None
    if not isinstance(value, str):
        raise Refused(f"must be a file path, got {value!r}")
    path = Path(value).expanduser()
    if not path.is_file():
        raise Refused(f"{what} file '{path}' does not exist")
    return path


DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "float32": "float32", "fp32": "float32", "auto": "auto"}


# -- generic converters --------------------------------------------------------------------------------
def to(key: str, check: Callable[[Any], Any] = lambda v: v, note: str = "") -> Convert:
    return lambda value, ctx: Out({key: check(value)}, note)


def na_unless_set(reason_unset: str, refusal: str) -> Convert:
    """Not applicable while null/empty/false/default; any other value is refused."""
    def convert(value: Any, ctx: Ctx) -> Out:
        if is_empty(value) or value is False:
            return na(reason_unset)
        raise Refused(refusal)
    convert.doc = f"unset: {reason_unset}; set: error ({refusal})"
    return convert


def refuse(reason: str) -> Convert:
    def convert(value: Any, ctx: Ctx) -> Out:
        raise Refused(reason)
    convert.doc = f"error: {reason}"
    return convert


def only(ok: tuple[Any, ...], reason: str, refusal: str) -> Convert:
    """Not applicable for the values in `ok` (they are what turnrl does anyway); others are refused."""
    def convert(value: Any, ctx: Ctx) -> Out:
        if value in ok:
            return na(reason)
        raise Refused(refusal)
    shown = " or ".join("null" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for v in ok)
    convert.doc = f"{shown}: {reason}; other values: error ({refusal})"
    return convert


def positive_one(what: str) -> Convert:
    def c(value: Any, ctx: Ctx) -> Out:
        if as_int(value) <= 1:
            return na("1: nothing to split")
        raise Refused(f"{what} > 1 is not available here")
    c.doc = "1: not applicable; > 1: error"
    return c
