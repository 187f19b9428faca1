"""Checks the config sections share."""

from __future__ import annotations

from turnrl.config.loader import ConfigError


def positive(name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"'{name}' must be {'>= 0' if allow_zero else '> 0'}, got {value}.")
