"""Translate a verl command line (`python3 -m verl.trainer.main_ppo key=value ...`) into a turnrl `Config`.

1. Parse the `key=value` tokens as hydra does: a leading `+` or `++` is dropped, values are YAML (`True`,
   `1e-6`, `'["wandb"]'`), and `$VAR`, `${VAR}` and `${oc.env:VAR[,default]}` are expanded from the
   environment first (an unset variable is an error that names it and its key). Other `${...}`
   interpolations are errors: write the value.
2. Look each key up in `verl_keys.RULES` (exact keys first, then patterns) and run its converter with the
   whole command line in view (`Ctx`): some keys combine (steps = epochs x rows // batch, the context is prompt
   + response, grpo without std division is drgrpo).
3. Apply verl's defaults for the keys that change what is learned and were left out (`VERL_DEFAULTS`).
4. Build the `Config` from the turnrl keys, then apply the user's own turnrl overrides (`--set`), so they win.
Every key gets one row in the translation table: honoured (the turnrl keys it set), verl default, not
applicable (why), ignored (unknown: only with allow_unknown) or error. Nothing is dropped without a row, and
any error stops the run after the whole table is printed.

After the config is built, `check_prompts` honours data.filter_overlong_prompts / truncation=error: it renders
each row's prompt (tool schemas included) and drops (into a filtered copy of the file) or refuses rows over
data.max_prompt_length tokens.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from turnrl.compat.verl_convert import Ctx, Out, Refused, Rule
from turnrl.compat.verl_keys import ALIASES, RULES, VERL_DEFAULTS
from turnrl.config import Config, ConfigError, config_from_dict, to_dict
from turnrl.config.loader import parse_override

HONOURED, DEFAULT, NA, IGNORED, ERROR, OVERRIDE = (
    "honoured", "verl default", "not applicable", "ignored (unknown)", "error", "turnrl override")

_ENV = re.compile(r"\$\{oc\.env:(\w+)(?:,([^}]*))?\}|\$\{(\w+)\}|\$(\w+)")
_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_SECRET = re.compile(r"(key|token|secret|password)$", re.IGNORECASE)
_EXACT = {r.pattern: r for r in RULES if "*" not in r.pattern}
_PATTERNS = [(re.compile("^" + r"\.".join("[^.]+" if p == "*" else ".+" if p == "**" else re.escape(p)
                                           for p in r.pattern.split(".")) + "$"), r)
             for r in RULES if "*" in r.pattern]


@dataclass
class Row:
    key: str
    value: Any
    turnrl: str
    status: str
    note: str = ""


@dataclass
class Translation:
    rows: list[Row] = field(default_factory=list)
    assign: dict[str, Any] = field(default_factory=dict)    # turnrl dotted key -> value
    owner: dict[str, str] = field(default_factory=dict)     # turnrl key -> the verl key that set it
    given: dict[str, Any] = field(default_factory=dict)     # verl key -> value, as parsed

    @property
    def errors(self) -> list[Row]:
        return [r for r in self.rows if r.status == ERROR]

    def config(self, overrides: list[str] | None = None) -> Config:
        return config_from_dict(_nest(self.assign), overrides or [])

    def prompt_check(self) -> tuple[str, int]:
        """('filter' or 'error', max prompt tokens): verl drops over-long prompts with filter_overlong_prompts,
        else refuses them (truncation=error, its default; other truncations are refused in the table)."""
        ctx = Ctx(self.given, VERL_DEFAULTS)
        mode = "filter" if ctx.get("data.filter_overlong_prompts") is True else "error"
        return mode, int(ctx.get("data.max_prompt_length"))

    def steps_for(self, rows: int) -> int | None:
        """trainer.steps again after the prompt check kept `rows` rows, when it was counted from epochs."""
        if self.owner.get("trainer.steps") != "trainer.total_epochs":
            return None
        ctx = Ctx(self.given, VERL_DEFAULTS)
        batch = int(ctx.get("data.train_batch_size"))
        if rows // batch == 0:
            raise ConfigError(f"after dropping over-long prompts {rows} row(s) are left, fewer than "
                              f"data.train_batch_size={batch}")
        return (rows // batch) * int(ctx.get("trainer.total_epochs"))


def lookup(key: str) -> Rule | None:
    if key in _EXACT:
        return _EXACT[key]
    return next((rule for regex, rule in _PATTERNS if regex.match(key)), None)


def expand(raw: str, env: Mapping[str, str], key: str, unset: dict[str, list[str]]) -> str:
    """`raw` with environment variables expanded; unset ones are added to `unset` (name -> keys)."""
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(3) or m.group(4)
        if name in env:
            return env[name]
        if m.group(2) is not None:   # ${oc.env:NAME,default}
            return m.group(2)
        unset.setdefault(name, []).append(key)
        return ""
    out = _ENV.sub(sub, raw)
    if "${" in out:
        raise ConfigError(f"'{key}': hydra interpolations ({out}) are not resolved here; write the value itself.")
    return out


def parse(tokens: list[str], env: Mapping[str, str]) -> list[tuple[str, Any]]:
    """verl `key=value` tokens -> [(key, value)], in order; every unset variable is reported at once."""
    out, problems, seen = [], [], set()
    unset: dict[str, list[str]] = {}
    for token in tokens:
        key, sep, raw = token.partition("=")
        key = key.strip().lstrip("+")
        if not sep or not key or key.startswith("~"):
            problems.append(f"'{token}': expected key=value (removing keys with ~ has no meaning here)")
            continue
        key = ALIASES.get(key, key)
        if not all(p and p.replace("_", "a").replace("-", "a").isalnum() for p in key.split(".")):
            problems.append(f"'{key}' is not a dotted key")
            continue
        if key in seen:
            problems.append(f"'{key}' is given twice")
            continue
        seen.add(key)
        try:
            text = expand(raw, env, key, unset)
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text   # e.g. a path with ': ' in it
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            value = float(value)
        out.append((key, value))
    if unset:
        problems.append("environment variable(s) not set (export them or write the values): " + ", ".join(
            f"${name} (in {', '.join(keys)})" for name, keys in unset.items()))
    if problems:
        raise ConfigError("verl command line: " + "; ".join(problems))
    return out


def translate(tokens: list[str], env: Mapping[str, str] | None = None, allow_unknown: bool = False) -> Translation:
    given = dict(parse(tokens, os.environ if env is None else env))
    t = Translation(given=given)
    ctx = Ctx(given, VERL_DEFAULTS)
    for key, value in given.items():
        rule = lookup(key)
        if rule is None:
            close = difflib.get_close_matches(key, [*_EXACT, *VERL_DEFAULTS], n=1, cutoff=0.7)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            note = "unknown verl key: not in turnrl's table." + hint
            t.rows.append(Row(key, value, "", IGNORED if allow_unknown else ERROR,
                              note + ("" if allow_unknown else " (--allow-unknown proceeds without it)")))
            continue
        t.rows.append(_apply(t, ctx, key, value, rule, HONOURED))
    for key in VERL_DEFAULTS:
        if key not in given:
            row = _apply(t, ctx, key, ctx.get(key), lookup(key), DEFAULT)
            if row.status == ERROR or (row.status == DEFAULT and row.turnrl):
                t.rows.append(row)
    return t


def _apply(t: Translation, ctx: Ctx, key: str, value: Any, rule: Rule, status: str) -> Row:
    ctx.key = key
    if rule.convert is None:
        return Row(key, value, "", NA, rule.note)
    try:
        out: Out = rule.convert(value, ctx)
    except (Refused, ConfigError) as exc:
        return Row(key, value, "", ERROR, str(exc))
    if not out.applicable:
        return Row(key, value, "", NA, out.note)
    defaults = _turnrl_defaults()
    shown = []
    for target, new in out.assign.items():
        if target in t.assign and t.assign[target] != new:
            if status == DEFAULT:
                continue   # a key on the command line decided it
            return Row(key, value, "", ERROR, f"sets {target}={new!r}, but {t.owner[target]} set it to "
                                              f"{t.assign[target]!r}")
        t.assign[target], t.owner[target] = new, key
        if status != DEFAULT or defaults.get(target, object()) != new:
            shown.append(f"{target}={_show(new)}")
    return Row(key, value, ", ".join(shown), status, out.note)


@functools.lru_cache(maxsize=1)
def _turnrl_defaults() -> dict[str, Any]:
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else k)
        else:
            flat[prefix] = node
    walk(to_dict(Config()), "")
    return flat


def _nest(assign: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in assign.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def _show(value: Any, limit: int = 48) -> str:
    text = "null" if value is None else yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    text = text.removesuffix("\n...").removesuffix(" ...")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_table(t: Translation, overrides: list[str] | None = None) -> str:
    rows = list(t.rows) + [Row(".".join(k), v, o, OVERRIDE, "applied last")
                           for o in overrides or [] for k, v in [parse_override(o)]]
    shown = [(r.key, "***" if _SECRET.search(r.key) else _show(r.value, 40), r.turnrl or "-",
              r.status + (f": {r.note}" if r.note else "")) for r in rows]
    head = ("verl key", "value", "turnrl", "status")
    widths = [max(len(x[i]) for x in [head, *shown]) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(head[:3], widths)) + "  " + head[3]]
    lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 6)
    for row in shown:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3])
    counts = {s: sum(r.status == s for r in rows) for s in (HONOURED, DEFAULT, NA, IGNORED, ERROR, OVERRIDE)}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return "\n".join(lines)


def key_table() -> str:
    """Every rule as a Markdown table (the README's migration table is this output)."""
    lines = ["| verl key | turnrl | notes |", "|---|---|---|"]
    for rule in RULES:
        default = VERL_DEFAULTS.get(rule.pattern)
        note = rule.note or getattr(rule.convert, "doc", "")
        if rule.pattern in VERL_DEFAULTS:
            shown = _show(default(Ctx({}, VERL_DEFAULTS)) if callable(default) else default)
            note += f" (verl's default {shown} applies when left out)"
        target = f"`{rule.target}`" if rule.target else "not applicable"
        lines.append(f"| `{rule.pattern}` | {target} | {note.strip()} |")
    return "\n".join(lines)


def error_summary(t: Translation) -> str:
    return (f"{len(t.errors)} verl key(s) cannot be honoured: "
            + "; ".join(f"{r.key}: {r.note}" for r in t.errors))


def check_rewards(cfg: Config) -> None:
    r = cfg.reward
    if r.functions or r.judge or cfg.rollout.tools or cfg.rollout.tool_config_path or cfg.rollout.interactions \
            or cfg.rollout.interaction_config_path:
        return
    raise ConfigError("no reward: verl's default compute_score picks a scorer by data_source, and turnrl has no "
                      "such table. Set custom_reward_function.path/name, or --set reward.functions=[exact_answer] "
                      "(a built-in), or give tools/interactions that reward.")


def check_prompts(cfg: Config, max_prompt_tokens: int, mode: str, out_dir: Path) -> tuple[list[str], int | None]:
    """Rows whose rendered prompt is over `max_prompt_tokens`: dropped into a filtered copy of the data file
    (mode 'filter'; the config is pointed at it) or a `DataError` (mode 'error').
    Returns (lines to print, training rows kept when some were dropped, else None)."""
    from turnrl.data import DataError, load_dataset
    from turnrl.models import resolve
    from turnrl.rollout.factory import build_environment, load_template
    template = load_template(resolve(cfg.model.name), cfg.model.chat_template, cfg.model.chat_template_kwargs)
    env = build_environment(cfg.rollout)
    schemas: dict[str, Any] = {}
    report, kept = [], None
    for which, d in (("train", cfg.data.train), ("eval", cfg.data.eval)):
        if d is None or d.path is None:
            continue
        tasks = load_dataset(d.path, None, max_rows=d.max_rows)
        over = []
        for i, task in enumerate(tasks):
            names = task.tools if task.tools is not None else (
                list(env.tool_factories) if env.default_tools is None else env.default_tools)   # as the agent loop
            for name in names:
                if name not in schemas and name in env.tool_factories:
                    schemas[name] = env.tool_factories[name]().schema
            tools = [schemas[n] for n in names if n in schemas]
            messages, tools_arg = template.prepare(task.messages, tools)
            n = len(template.encode(template.render(messages, tools_arg, add_generation_prompt=True)))
            if n > max_prompt_tokens:
                over.append((i, task.uid, n))
        if over and mode == "error":
            listed = ", ".join(f"row {i} ({uid}): {n} tokens" for i, uid, n in over[:5])
            raise DataError(f"{d.path}: {len(over)} prompt(s) over data.max_prompt_length={max_prompt_tokens} "
                            f"(data.truncation=error): {listed}. Drop them with data.filter_overlong_prompts=True "
                            "or raise data.max_prompt_length.")
        if over:
            d.path = str(_filtered_copy(Path(d.path), [i for i, _, _ in over], len(tasks), out_dir, which))
            d.max_rows = None
        report.append(f"prompt check ({which}): {len(over)} of {len(tasks)} rows over {max_prompt_tokens} tokens"
                      + (f", dropped: now reading {d.path}" if over else ""))
        if which == "train" and over:
            kept = len(tasks) - len(over)
    return report, kept


def _filtered_copy(path: Path, drop: list[int], n: int, out_dir: Path, which: str) -> Path:
    dropped = set(drop)
    keep = [i for i in range(n) if i not in dropped]
    out_dir.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        out = out_dir / f"verl_{which}_filtered.parquet"
        pq.write_table(pq.read_table(path).take(keep), out)
        return out
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    out = out_dir / f"verl_{which}_filtered.jsonl"
    out.write_text("".join(lines[i] + "\n" for i in keep))
    return out
