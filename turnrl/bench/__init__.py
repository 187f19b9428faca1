"""Benchmarks. Each prints a table and writes JSON (`turnrl bench ...`)."""
