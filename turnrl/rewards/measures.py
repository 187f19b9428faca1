"""Conversation metrics computed without an LLM: BLEU against a reference, and the pass rate of code.

`bleu`: sentence BLEU-4 (Papineni et al., 2002) on lower-cased word/punctuation tokens with add-one
smoothing of the 2- to 4-gram precisions (Lin and Och, 2004, "smoothing 2"), times the brevity penalty.
`pass_rate`: the last fenced code block of a message (else the whole message) is run with each test
appended, in a fresh `python -I` subprocess with a timeout, in a temporary directory; the score is the share
of tests that exit 0. This is isolation from turnrl, not a sandbox.
"""

from __future__ import annotations

import asyncio
import math
import re
import sys
import tempfile
from collections import Counter
from typing import Any

TOKEN = re.compile(r"\w+|[^\w\s]")
FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)


def bleu(candidate: str, reference: str, max_n: int = 4) -> float:
    cand, ref = TOKEN.findall(candidate.lower()), TOKEN.findall(reference.lower())
    if not cand or not ref:
        return 0.0
    log_precision = 0.0
    for n in range(1, max_n + 1):
        c = Counter(tuple(cand[i:i + n]) for i in range(len(cand) - n + 1))
        r = Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
        overlap, total = sum((c & r).values()), max(len(cand) - n + 1, 0)
        if n == 1:
            if overlap == 0:
                return 0.0
            log_precision += math.log(overlap / total)
        else:
            log_precision += math.log((overlap + 1) / (total + 1))
    brevity = min(0.0, 1 - len(ref) / len(cand))
    return math.exp(brevity + log_precision / max_n)


def extract_code(text: str) -> str:
    blocks = FENCE.findall(text)
    return blocks[-1] if blocks else text


def tests_of(info: dict[str, Any]) -> list[str]:
    """The row's tests: `extra.tests` (a string or a list), else the ground truth."""
    tests = (info.get("extra") or {}).get("tests", info.get("ground_truth"))
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError("pass_rate needs the row's tests: extra.tests (a string or a list of strings) or a "
                         "ground_truth string with test code")
    return tests


async def run_python(source: str, timeout_s: float) -> bool:
    with tempfile.TemporaryDirectory(prefix="turnrl-pass-") as tmp:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", source, cwd=tmp, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            return await asyncio.wait_for(proc.wait(), timeout_s) == 0
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            return False


async def pass_rate(text: str, tests: list[str], timeout_s: float) -> float:
    code = extract_code(text)
    passed = await asyncio.gather(*(run_python(f"{code}\n\n{test}\n", timeout_s) for test in tests))
    return sum(passed) / len(tests)
