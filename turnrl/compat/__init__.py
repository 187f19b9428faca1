"""Compatibility with other frameworks' files and interfaces (verl, verifiers)."""

from turnrl.compat import verl  # noqa: E402,F401 (registers verl's tool and interaction adapters with turnrl.env)
from turnrl.compat import verifiers_hooks  # noqa: E402,F401 (registers verifiers' rows, tools and interaction)
