"""Typed config loading: YAML mappings and dotted overrides into nested dataclasses.

Every key is checked against the dataclass it lands in. An unknown key, a value of the wrong type, or an
override that does not parse is a `ConfigError` that names the full dotted key and, for unknown keys,
suggests the closest valid one. Nothing is ever silently ignored.

Supported field types: bool, int, float, str, `Literal[...]`, `X | None`, `list[X]`, `dict[str, X]`,
nested dataclasses and `Any` (free-form values handed to user code, e.g. a tool's own config).
Fields whose metadata has `secret=True` are redacted by `to_dict(..., redact=True)` (a reference, `env:NAME` or
`file:PATH`, is shown as written) and never echoed in errors;
an override whose key ends like a secret's (`..._key`, `token`, `secret`, `password`) is shown as `KEY=***` in
the errors about its syntax, which come before the key is matched to a field.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")
REDACTED = "***"


class ConfigError(ValueError):
    """A config value a user must change; the message says which key and how."""


def secret(default: Any = None) -> Any:
    """A dataclass field that is never printed (API keys and the like)."""
    return dataclasses.field(default=default, metadata={"secret": True})


def _type_name(tp: Any) -> str:
    if tp is Any:
        return "any value"
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of {_type_name(get_args(tp)[1])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _suggest(key: str, valid: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f" Did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else ""
    return f"{hint} Valid keys: {', '.join(sorted(valid))}."


def _same_shape(value: Any, tp: Any) -> bool:
    if isinstance(value, dict):
        return dataclasses.is_dataclass(tp) or get_origin(tp) is dict
    return isinstance(value, list) and get_origin(tp) is list


# PyYAML follows YAML 1.1, where `1e-5` (no dot) is a string, not a float. Accept it for float fields.
_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against type `tp` and return it converted (dataclasses built, ints widened)."""
    if tp is Any:
        return value
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        shaped = None  # the error of the alternative whose shape matches (a mapping for a dataclass, ...)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError as exc:
                if shaped is None and _same_shape(value, arg):
                    shaped = exc
        if shaped is not None:  # e.g. an unknown key inside an optional section: report that, not the union
            raise shaped
        raise ConfigError(f"'{key}' must be {_type_name(tp)}, got {value!r}.")
    if origin is Literal:
        if value in get_args(tp) and not isinstance(value, bool):
            return value
        if isinstance(value, bool):  # YAML 1.1 reads on/off/yes/no as booleans
            for word in (("on", "yes", "true") if value else ("off", "no", "false")):
                if word in get_args(tp):
                    return word
        close = difflib.get_close_matches(str(value), [str(a) for a in get_args(tp)], n=1, cutoff=0.4)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"'{key}' must be {_type_name(tp)}, got {value!r}.{hint}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"'{key}' must be {_type_name(tp)}, got {value!r}.")
        (item,) = get_args(tp)
        return [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"'{key}' must be {_type_name(tp)}, got {value!r}.")
        _, item = get_args(tp)
        return {str(k): _convert(v, item, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"'{key}' must be {_type_name(tp)}, got {value!r}.")
        return build(tp, value, prefix=key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"'{key}' must be true or false, got {value!r}.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"'{key}' must be an integer, got {value!r}.")
    if tp is float:
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            value = float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                raise ConfigError(f"'{key}' is too large for a number (a {value.bit_length()}-bit integer).") from None
        raise ConfigError(f"'{key}' must be a number, got {value!r}.")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"'{key}' must be a string, got {value!r} (quote it in YAML).")
    raise TypeError(f"unsupported config field type {tp!r} at '{key}'")


def build(cls: type[T], data: dict[str, Any] | None, prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping; every key must be a field of `cls`."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            removed: dict[str, str] = getattr(cls, "removed_keys", {})   # a ClassVar of the config dataclass
            if key in removed:
                raise ConfigError(f"Config key '{full}' was removed: {removed[key]}.")
            raise ConfigError(f"Unknown config key '{full}'." + _suggest(str(key), list(fields), prefix))
        if fields[key].metadata.get("secret"):
            try:
                kwargs[key] = _convert(value, hints[key], full)
            except ConfigError:  # the message would hold the secret itself
                raise ConfigError(f"'{full}' must be {_type_name(hints[key])} (value not shown: it is secret; "
                                  "quote it in YAML).") from None
        else:
            kwargs[key] = _convert(value, hints[key], full)
    try:
        obj = cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        where = f" under '{prefix}'" if prefix else ""
        raise ConfigError(f"Missing required config key(s){where}: {', '.join(missing)}.") from exc
    check = getattr(obj, "validate", None)
    if check is not None:
        try:
            check()
        except ConfigError as exc:
            raise ConfigError(f"{prefix + ': ' if prefix else ''}{exc}") from None
    return obj


_SECRET_NAME = re.compile(r"(key|token|secret|password)$", re.IGNORECASE)


def _shown(text: str) -> str:
    """An override as error messages may quote it: without the value when the key names a secret."""
    key, sep, _ = text.partition("=")
    return f"{key}=***" if sep and _SECRET_NAME.search(key.strip()) else text


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a', 'b', 'c'], parsed value). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"Bad override '{text}': expected KEY=VALUE, e.g. rollout.n=8.")
    key, _, raw = text.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p or not p.replace("_", "a").replace("-", "a").isalnum() for p in parts):
        raise ConfigError(f"Bad override '{_shown(text)}': the key '{key}' must be dotted names like model.lora.rank.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError, RecursionError) as exc:  # ValueError: ints past 4300 digits
        raise ConfigError(f"Bad override '{_shown(text)}': the value does not parse ({exc.__class__.__name__}). "
                          "Quote strings that contain ':' or brackets.") from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Merge dotted overrides into a plain mapping (validation happens in `build`).

    A numeric part indexes into a list that is already there: `rollout.tools.0.config.x=1`.
    """
    out = _deep_copy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node: Any = out
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            where = ".".join(parts[:i])
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"Bad override '{_shown(text)}': '{where}' is a list of {len(node)} item(s); "
                                      f"'{part}' is not an index into it (0 to {len(node) - 1}).")
                part = int(part)
            elif not isinstance(node, dict):
                raise ConfigError(f"Bad override '{_shown(text)}': '{where}' is a value, not a section.")
            if last:
                node[part] = value
                break
            child = node[part] if isinstance(node, list) else node.get(part)
            if child is None:
                child = node[part] = {}
            node = child
    return out


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def _cycle(value: Any, key: str = "", inside: tuple[int, ...] = ()) -> str | None:
    """The dotted key of a container that contains itself (a recursive YAML alias), else None."""
    if not isinstance(value, (dict, list)):
        return None
    if id(value) in inside:
        return key
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for k, v in items:
        found = _cycle(v, f"{key}.{k}" if key else str(k), inside + (id(value),))
        if found is not None:
            return found
    return None


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Config file '{path}' does not exist.")
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        raise ConfigError(f"Config file '{path}' is not valid YAML: {exc}") from None
    cycle = _cycle(data)
    if cycle is not None:
        raise ConfigError(f"Config file '{path}': '{cycle or '(top)'}' refers to itself through a YAML alias "
                          f"(&anchor ... *anchor inside itself); write the value out instead.")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"Config file '{path}' must hold a mapping at the top, got {type(data).__name__}.")
    return data


# A name that holds a secret: *_KEY, *_TOKEN, *SECRET*, *PASSWORD, *_PAT, credentials, auth (as a word of the
# name, so KEYBOARD or TOKENIZER do not match).
SECRET_NAME = re.compile(r"(^|[_\-.])(API_?KEY|KEY|TOKEN|SECRET|SECRET_ACCESS_KEY|PASSWORD|PASSWD|PASS|PWD|PAT|"
                         r"CREDENTIALS?|AUTH|AUTHORIZATION|BEARER|COOKIE)S?($|[_\-.])", re.IGNORECASE)
URL_CREDENTIALS = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s/:@]*:)([^\s/@]+)@")


def redact_urls(text: str) -> str:
    """`scheme://user:password@host` -> `scheme://user:***@host`."""
    return URL_CREDENTIALS.sub(lambda m: m.group(1) + REDACTED + "@", text)


def to_dict(obj: Any, redact: bool = True) -> Any:
    """A dataclass tree as plain data. With `redact`: secret fields and values under a secret-looking key
    (`extra_body: {api_key: ...}`) become '***' when set, and passwords inside URLs are masked."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if redact and f.metadata.get("secret") and value and not is_reference(value):
                out[f.name] = REDACTED
            else:
                out[f.name] = to_dict(value, redact)
        return out
    if isinstance(obj, list):
        return [to_dict(v, redact) for v in obj]
    if isinstance(obj, dict):
        return {k: REDACTED if redact and isinstance(k, str) and SECRET_NAME.search(k) and isinstance(v, str)
                and v and not is_reference(v) else to_dict(v, redact) for k, v in obj.items()}
    if redact and isinstance(obj, str) and "://" in obj:
        return redact_urls(obj)
    return obj


def is_reference(value: Any) -> bool:
    """A secret given as `env:NAME` or `file:PATH` (see turnrl.config.secrets): safe to show."""
    return isinstance(value, str) and value.startswith(("env:", "file:")) and len(value.split(":", 1)[1]) > 0


class _Dumper(yaml.SafeDumper):
    """Strings with characters PyYAML's plain or single-quoted styles do not bring back (a NEL, U+2028/2029
    line separators, control characters) are written double-quoted, with escapes: '\x85' single-quoted reads
    back as ' '."""


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    odd = not value.isprintable() or any(c in value for c in "\x85\u2028\u2029")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style='"' if odd else None)


_Dumper.add_representer(str, _string)


def dump_yaml(obj: Any, redact: bool = True) -> str:
    return yaml.dump(to_dict(obj, redact), Dumper=_Dumper, sort_keys=False, allow_unicode=True)
