"""Classes written against verl's BaseTool / BaseInteraction interfaces run here without verl."""

import asyncio
from uuid import uuid4

import pytest

from turnrl.compat.verl import VerlInteractionAdapter, VerlToolAdapter, is_verl_interaction, is_verl_tool
from turnrl.config.schema import InteractionSpec, ToolSpec
from turnrl.env.loading import interaction_factory, tool_factory
from turnrl.env.tools import ToolSession
from turnrl.ledger import ToolCall

SCHEMA = {"type": "function", "function": {
    "name": "tally", "description": "Add to a running tally.",
    "parameters": {"type": "object", "properties": {"amount": {"type": "integer"}}, "required": ["amount"]}}}


class TallyTool:
    """verl's BaseTool shape: one object serves many instances, keyed by instance_id."""
    events = []

    def __init__(self, config: dict, tool_schema):
        self.config = config
        self.tool_schema = tool_schema
        self.name = tool_schema.function.name        # verl reads the pydantic schema by attribute
        self._instances = {}

    async def create(self, instance_id=None, start=0, **kwargs):
        instance_id = instance_id or str(uuid4())
        self._instances[instance_id] = {"tally": start, "calls": 0}
        TallyTool.events.append(("create", instance_id, start))
        return instance_id, {"text": ""}

    async def execute(self, instance_id, parameters, **kwargs):
        state = self._instances[instance_id]            # KeyError if create was not called for this id
        state["tally"] += parameters["amount"] * self.config.get("scale", 1)
        state["calls"] += 1
        return {"text": f"tally={state['tally']}"}, 0.1, {"calls": state["calls"]}

    async def calc_reward(self, instance_id, **kwargs):
        TallyTool.events.append(("calc_reward", instance_id))
        return float(self._instances[instance_id]["tally"])

    async def release(self, instance_id, **kwargs):
        TallyTool.events.append(("release", instance_id))
        del self._instances[instance_id]


class QuizInteraction:
    """verl's BaseInteraction shape."""
    events = []

    def __init__(self, config: dict):
        self.config = config
        self._instances = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        self._instances[instance_id] = {"truth": str(ground_truth), "turns": 0, "right": False}
        QuizInteraction.events.append(("start", ground_truth))
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        state = self._instances[instance_id]
        state["turns"] += 1
        answer = messages[-1]["content"].strip()
        state["right"] = answer == state["truth"]
        if state["right"]:
            return True, "Well done.", 1.0, {"turns": state["turns"]}
        return False, self.config.get("retry", "Try again."), 0.0, {}

    async def calculate_score(self, instance_id, **kwargs):
        QuizInteraction.events.append(("score", instance_id))
        if self.config.get("score_fails"):
            raise RuntimeError("scoring service down")
        return 1.0 if self._instances[instance_id]["right"] else 0.0

    async def finalize_interaction(self, instance_id, **kwargs):
        QuizInteraction.events.append(("finalize", instance_id))
        del self._instances[instance_id]


def tally_call(amount):
    return ToolCall("tally", {"amount": amount}, "", "call_0")


@pytest.fixture(autouse=True)
def clear_events():
    TallyTool.events.clear()
    QuizInteraction.events.clear()


def test_recognised_by_shape():
    assert is_verl_tool(TallyTool) and not is_verl_interaction(TallyTool)
    assert is_verl_interaction(QuizInteraction) and not is_verl_tool(QuizInteraction)
    from turnrl.env.builtin.calculator import Calculator
    assert not is_verl_tool(Calculator)


def test_verl_tool_state_persists_and_reward_release_are_called():
    name, make = tool_factory(ToolSpec(class_name=f"{__name__}:TallyTool", config={"scale": 10}, tool_schema=SCHEMA))
    assert name == "tally"
    tool = make()
    assert isinstance(tool, VerlToolAdapter) and tool.schema == SCHEMA
    # verl rows wrap create kwargs in create_kwargs; both spellings reach create()
    session = ToolSession({"tally": tool}, {"tally": {"create_kwargs": {"start": 5}}})

    async def scenario():
        await session.create()
        first = await session.execute_all([tally_call(1)])
        second = await session.execute_all([tally_call(2)])
        return first[0], second[0], await session.rewards(), await session.release()
    first, second, (rewards, reward_errors), release_errors = asyncio.run(scenario())
    assert (first.text, first.reward, first.metrics) == ("tally=15", 0.1, {"calls": 1})
    assert (second.text, second.metrics) == ("tally=35", {"calls": 2})     # state kept between calls
    assert rewards == {"tally": 35.0} and reward_errors == [] and release_errors == []
    instance = tool.instance_id
    assert TallyTool.events == [("create", instance, 5), ("calc_reward", instance), ("release", instance)]
    assert tool.inner._instances == {}


def test_each_trajectory_gets_its_own_verl_instance():
    _, make = tool_factory(ToolSpec(class_name=f"{__name__}:TallyTool", tool_schema=SCHEMA))
    a, b = make(), make()
    assert a.inner is not b.inner and a.instance_id != b.instance_id
    sa, sb = ToolSession({"tally": a}, {"tally": {"start": 0}}), ToolSession({"tally": b}, {"tally": {"start": 100}})

    async def scenario():
        await asyncio.gather(sa.create(), sb.create())
        ra, rb = await asyncio.gather(sa.execute_all([tally_call(1)]), sb.execute_all([tally_call(1)]))
        return ra[0].text, rb[0].text
    assert asyncio.run(scenario()) == ("tally=1", "tally=101")


def test_verl_tool_needs_a_schema():
    with pytest.raises(ValueError, match="needs a 'tool_schema'"):
        tool_factory(ToolSpec(class_name=f"{__name__}:TallyTool"))


def test_verl_interaction_lifecycle():
    make = interaction_factory(InteractionSpec(name="quiz", class_name=f"{__name__}:QuizInteraction",
                                               config={"retry": "Nope."}))
    user = make()
    assert isinstance(user, VerlInteractionAdapter)

    async def scenario():
        await user.start(ground_truth=12)
        wrong = await user.respond([{"role": "user", "content": "6+6?"}, {"role": "assistant", "content": "13"}])
        right = await user.respond([{"role": "assistant", "content": "12"}])
        return wrong, right, await user.finish()
    wrong, right, score = asyncio.run(scenario())
    assert (wrong.text, wrong.done, wrong.reward) == ("Nope.", False, 0.0)
    assert (right.text, right.done, right.reward, right.info) == ("Well done.", True, 1.0, {"turns": 2})
    assert score == 1.0
    iid = user.instance_id
    assert QuizInteraction.events == [("start", 12), ("score", iid), ("finalize", iid)]
    assert user.inner._instances == {}


def test_verl_interaction_is_finalized_even_when_scoring_fails():
    user = interaction_factory(InteractionSpec(name="quiz", class_name=f"{__name__}:QuizInteraction",
                                               config={"score_fails": True}))()

    async def scenario():
        await user.start(ground_truth=1)
        with pytest.raises(RuntimeError, match="scoring service down"):
            await user.finish()
    asyncio.run(scenario())
    assert [e[0] for e in QuizInteraction.events] == ["start", "score", "finalize"]
