"""Observability: progress, console tables, metrics sinks."""
