"""Small environments written against the installed verifiers release (classic API), for
tests/env/test_verifiers_env.py. Each `load_*` is a `load_environment` as an Environments Hub package has."""

from datasets import Dataset

import verifiers as vf

QUESTIONS = [{"question": "What is 2 + 3?", "answer": "5"}, {"question": "What is 4 + 4?", "answer": "8"}]


def _said(completion):
    return str(completion[-1].content if hasattr(completion[-1], "content") else completion[-1]["content"])


def correct(completion, answer, **kwargs) -> float:
    return 1.0 if answer in _said(completion) else 0.0


def short(completion, **kwargs) -> float:
    return 1.0 if len(_said(completion)) < 40 else 0.0


def load_single(system_prompt: str = "Answer with a number only."):
    return vf.SingleTurnEnv(dataset=Dataset.from_list(QUESTIONS), eval_dataset=Dataset.from_list(QUESTIONS[:1]),
                            system_prompt=system_prompt, rubric=vf.Rubric(funcs=[correct, short], weights=[1.0, 0.5]))


class RetryEnv(vf.MultiTurnEnv):
    """The user says 'wrong' until the answer is right; solved ends it (a @vf.stop of its own)."""

    async def setup_state(self, state):
        state["tries"] = 0
        return state

    @vf.stop
    async def solved(self, state) -> bool:
        return bool(state.get("solved"))

    async def env_response(self, messages, state, **kwargs):
        state["tries"] += 1
        if state["answer"] in _said(messages):
            state["solved"] = True
            return [vf.UserMessage(content="Correct.")]
        return [vf.UserMessage(content=f"Wrong (try {state['tries']}), again.")]


def tries(state, **kwargs) -> float:
    return float(state["tries"])


def load_retry(max_turns: int = 3):
    rubric = vf.Rubric(funcs=[correct, tries], weights=[1.0, 0.0])
    return RetryEnv(dataset=Dataset.from_list(QUESTIONS), rubric=rubric, max_turns=max_turns)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first
        b: second
    """
    return a + b


def explode() -> str:
    """A tool whose backend is down."""
    raise RuntimeError("backend down")


def load_tools():
    return vf.ToolEnv(dataset=Dataset.from_list(QUESTIONS), tools=[add, explode], max_turns=4,
                      rubric=vf.Rubric(funcs=[correct]))


class VaultEnv(vf.StatefulToolEnv):
    """`peek` takes a key the model never sees: update_tool_args injects it from the state."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_tool(peek, args_to_skip=["key"])

    async def setup_state(self, state):
        state["key"] = f"k{state['answer']}"
        state["peeks"] = 0
        return await super().setup_state(state)

    def update_tool_args(self, tool_name, tool_args, messages, state, **kwargs):
        state["peeks"] += 1
        return {**tool_args, "key": state["key"]}


def peek(slot: int, key: str) -> str:
    """Look into a slot of the vault.

    Args:
        slot: which slot
    """
    return f"slot {slot} opened with {key}"


def peeks(state, **kwargs) -> float:
    return float(state["peeks"])


def load_vault():
    return VaultEnv(dataset=Dataset.from_list(QUESTIONS), max_turns=3, rubric=vf.Rubric(funcs=[peeks]))


class Branching(vf.MultiTurnEnv):
    async def get_prompt_messages(self, state):
        return state["prompt"]

    async def env_response(self, messages, state, **kwargs):
        return []


def load_branching():
    return Branching(dataset=Dataset.from_list(QUESTIONS))


def group_reward(completions, **kwargs) -> list[float]:
    return [1.0 for _ in completions]


def load_grouped():
    return vf.SingleTurnEnv(dataset=Dataset.from_list(QUESTIONS), rubric=vf.Rubric(funcs=[group_reward]))
