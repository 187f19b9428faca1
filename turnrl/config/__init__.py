"""Config: one dataclass per component (`schema`), strict YAML + dotted-override loading (`loader`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from turnrl.config.loader import ConfigError, apply_overrides, build, dump_yaml, read_yaml, to_dict
from turnrl.config.schema import Config

__all__ = ["Config", "ConfigError", "load_config", "config_from_dict", "dump_yaml", "to_dict"]


def config_from_dict(data: dict[str, Any], overrides: list[str] | None = None) -> Config:
    return build(Config, apply_overrides(data, overrides or []))


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or start from defaults when `path` is None) and apply `key=value` overrides."""
    data = read_yaml(path) if path is not None else {}
    return config_from_dict(data, overrides)
