"""Compatibility with other frameworks' files and interfaces (verl)."""
