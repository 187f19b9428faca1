"""Extracting and comparing final answers in model text."""

from __future__ import annotations

import re
from fractions import Fraction

HASH = re.compile(r"####\s*([-+]?[\d,]*\.?\d+)")
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
NUMBER = re.compile(r"[-+]?\d[\d,]*\.?\d*|[-+]?\.\d+")


def _clean(num: str) -> str:
    return num.replace(",", "").strip().rstrip(".")


def extract_answer(text: str, strict: bool = False) -> str | None:
    """`#### N`, then `\\boxed{N}`, then (unless `strict`) the last number in the text."""
    for pattern in (HASH, BOXED):
        found = pattern.findall(text)
        if found:
            return _clean(found[-1])
    if strict:
        return None
    numbers = NUMBER.findall(text)
    return _clean(numbers[-1]) if numbers else None


def as_number(text: str | None) -> Fraction | None:
    if text is None:
        return None
    try:
        return Fraction(_clean(str(text)))
    except (ValueError, ZeroDivisionError):
        return None


def same_number(a: object, b: object) -> bool:
    x, y = as_number(None if a is None else str(a)), as_number(None if b is None else str(b))
    return x is not None and y is not None and x == y
