"""Command-line entry points. Each command parses its arguments and calls into the package; no logic here."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Callable

from turnrl.chat.templates import TemplateError
from turnrl.config import ConfigError, dump_yaml, load_config
from turnrl.data import DataError
from turnrl.models import ALIASES, ModelError, is_prepared, model_dir, prepare, resolve
from turnrl.train.health import AllMaskedError

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help_text: str, args: Callable[[argparse.ArgumentParser], None]):
    def register(fn: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = (help_text, args, fn)
        return fn
    return register


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.n=8 model.lora.rank=16")


# -- models --------------------------------------------------------------------------------------------
def _models_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="list built-in models and whether they are prepared")
    for action in ("prepare", "path"):
        q = sub.add_parser(action, help=f"{action} a model spec (alias, local dir, cached hub id)")
        q.add_argument("name")


@command("models", "list, prepare and locate models", _models_args)
def cmd_models(a: argparse.Namespace) -> int:
    if a.action == "list":
        for name, alias in ALIASES.items():
            state = f"prepared at {model_dir(name)}" if is_prepared(name) else "not prepared"
            print(f"{name:24s} {alias.description}  [{state}]")
        return 0
    path = prepare(a.name) if a.action == "prepare" and a.name in ALIASES else resolve(a.name)
    print(path)
    return 0


# -- config --------------------------------------------------------------------------------------------
def _show_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    _config_args(sub.add_parser("show", help="print the fully resolved config (secrets redacted)"))


@command("config", "show the resolved config", _show_args)
def cmd_config(a: argparse.Namespace) -> int:
    print(dump_yaml(load_config(a.config, a.overrides)), end="")
    return 0


# -- rollout -------------------------------------------------------------------------------------------
def _rollout_args(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--out", required=True, help="output directory (trajectories.jsonl, summary.json)")
    p.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    p.add_argument("--min-reward", type=float, default=None,
                   help="also write accepted.jsonl: trajectories with reward >= this (rejection sampling)")


@command("rollout", "run multi-turn rollouts and save the trajectories", _rollout_args)
def cmd_rollout(a: argparse.Namespace) -> int:
    from turnrl.collect import rollout_to_dir
    cfg = load_config(a.config, a.overrides)
    summary = asyncio.run(rollout_to_dir(cfg, Path(a.out), a.limit, a.min_reward))
    from turnrl.observe.progress import format_table
    print(format_table(summary, f"rollout summary ({a.out}/trajectories.jsonl)"))
    return 0


# -- check-template ------------------------------------------------------------------------------------
def _check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model spec whose tokenizer and chat template are checked")
    p.add_argument("--on-mismatch", choices=["error", "warn", "split"], default="error")
    p.add_argument("--chat-template", default=None, help="a Jinja file to check in place of the model's template")
    p.add_argument("--kwarg", action="append", default=[], metavar="NAME=VALUE",
                   help="a chat_template_kwargs entry (YAML value), e.g. enable_thinking=false; repeatable")


@command("check-template", "check token-delta parity of a model's chat template", _check_args)
def cmd_check_template(a: argparse.Namespace) -> int:
    import yaml

    from turnrl.chat.detect import detect_parser
    from turnrl.chat.parity import check_template
    from turnrl.rollout.factory import load_template
    if any("=" not in k for k in a.kwarg):
        raise ConfigError(f"--kwarg takes NAME=VALUE, got {[k for k in a.kwarg if '=' not in k]}")
    kwargs = {k.split("=", 1)[0]: yaml.safe_load(k.split("=", 1)[1]) for k in a.kwarg}
    template = load_template(resolve(a.model), a.chat_template, kwargs)
    print(f"assistant suffix {template.assistant_suffix!r}, stop tokens {list(template.stop_token_ids)}, "
          f"tools {'native' if template.native_tools else 'injected'}")
    found = detect_parser(template)
    print(f"tool calls: {found.parser or 'CANNOT DETECT'} ({found.reason})"
          + ("" if found.parser else "; set rollout.tool_parser yourself"))
    failed = 0
    for report in check_template(template, a.on_mismatch):
        ok = report.result in ("exact", "token_drift", "split")
        failed += not ok
        print(f"  {'PASS' if ok else 'FAIL'} {report.name:20s} {report.result}")
        if report.detail:
            print("    " + report.detail.replace("\n", "\n    "))
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnrl", description="Token-exact multi-turn RL for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_args, fn) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(func=fn)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line; `key=value` overrides may also come after the options."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    return args


def main(argv: list[str] | None = None) -> int:
    _register_optional_commands()
    args = parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, DataError, ModelError, TemplateError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except AllMaskedError as exc:   # the run stopped itself, with the reason and what to do
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _register_optional_commands() -> None:
    """Commands that live with their subsystem register themselves here."""
    import importlib
    for module in ("turnrl.train.cli", "turnrl.bench.cli", "turnrl.observe.cli", "turnrl.compat.cli",
                   "turnrl.gateway.cli"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module.startswith(exc.name):
                raise


if __name__ == "__main__":  # commands register on `turnrl.cli`, not on this `__main__` copy
    from turnrl.cli import main as package_main
    sys.exit(package_main())
