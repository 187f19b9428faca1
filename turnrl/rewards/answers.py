"""Extracting and comparing final answers in model text."""

from __future__ import annotations

import re
from fractions import Fraction

HASH = re.compile(r"####\s*\$?\s*([-+]?[\d,]*\.?\d+(?:\s*/\s*\d+)?)")
BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")   # one level of nested braces: \boxed{\frac{3}{4}}
FRAC = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")
NUMBER = re.compile(r"[-+]?\d[\d,]*\.?\d*(?:/\d+)?|[-+]?\.\d+")


def _clean(num: str) -> str:
    num = FRAC.sub(r"\1/\2", num)
    return num.replace(",", "").replace("$", "").replace(" ", "").strip().rstrip(".")


def extract_answer(text: str, strict: bool = False) -> str | None:
    """`#### N`, then `\\boxed{N}`, then (unless `strict`) the last number in the text. Numbers may have
    thousands commas, a sign, decimals or a fraction (`3/4`, `\\frac{3}{4}`)."""
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
