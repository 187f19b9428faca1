"""A scripted engine for fault injection: every way a policy turn can go wrong, on demand.

Each task's prompt carries a tag `[case:NAME]`; the engine answers that case's script turn by turn. A script
entry is a text (its tokens plus `<|im_end|>`, finish 'stop'), a `Turn` (the exact token ids, logprobs and
finish reason, for partial, aborted or malformed completions) or an exception to raise. The last entry
repeats, so a one-entry script is a policy that never stops doing the same thing.
"""

import asyncio
import re
from collections import defaultdict
from dataclasses import dataclass

from turnrl.engines.base import Completion, EngineBase

TAG = re.compile(r"\[case:(\w+)\]")


@dataclass
class Turn:
    text: str = ""
    finish: str = "stop"
    ids: list | None = None          # exact token ids instead of the text's
    logprobs: list | None = None     # default: one -0.5 per token


class FaultEngine(EngineBase):
    def __init__(self, template, scripts):
        self.template = template
        self.scripts = scripts
        self.turns = defaultdict(int)

    async def generate(self, prompt_ids, sampling):
        await asyncio.sleep(0)
        tag = TAG.findall(self.template.decode(prompt_ids))[-1]
        script = self.scripts[tag]
        entry = script[min(self.turns[tag], len(script) - 1)]
        self.turns[tag] += 1
        if isinstance(entry, BaseException):
            raise entry
        if isinstance(entry, str):
            entry = Turn(entry)
        ids = list(entry.ids) if entry.ids is not None else self.template.encode(entry.text)
        if entry.ids is None and entry.finish == "stop":
            ids.append(self.template.stop_token_ids[0])
        ids = ids[:sampling.max_tokens]
        logprobs = entry.logprobs if entry.logprobs is not None else [-0.5] * len(ids)
        return Completion(ids, logprobs, entry.finish)

    async def update_weights(self, named_tensors, version):
        return None

    async def close(self):
        return None
