"""A scripted policy for the environment tests: real tokenizer and chat template, texts from a script."""

import json

from turnrl.engines.base import Completion, EngineBase


class ScriptedPolicy(EngineBase):
    """Answers each trajectory with the next text of the script whose key appears in its prompt (a
    `[case:NAME]` tag or a question)."""

    def __init__(self, template, scripts):
        self.template, self.scripts, self.turns = template, scripts, {}

    async def generate(self, prompt_ids, sampling):
        text = self.template.decode(prompt_ids)
        tag = next(k for k in self.scripts if k in text)
        key = (tag, sampling.session)
        turn = self.turns.get(key, 0)
        self.turns[key] = turn + 1
        script = self.scripts[tag]
        ids = self.template.encode(script[min(turn, len(script) - 1)]) + [self.template.stop_token_ids[0]]
        return Completion(ids, [-0.5] * len(ids), "stop")


def call(name, **args):
    """A hermes tool call."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'
