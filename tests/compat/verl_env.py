"""A tool and an interaction written against verl's interfaces (`BaseTool`, `BaseInteraction`), without verl.

Loaded by class name from verl-format YAML files in tests/compat/test_verl_cli.py. Both keep per-instance
state keyed by instance_id, as verl's classes do, and log every lifecycle call in `EVENTS` so a test can see
that state persisted across calls and that calc_reward / finalize_interaction were called.
"""

from uuid import uuid4

EVENTS: list[tuple] = []


class CounterTool:
    """verl BaseTool shape: `counter` adds `step` (default 1) to a running count and reports it."""

    def __init__(self, config: dict, tool_schema):
        self.config = config
        self.name = tool_schema.function.name      # verl reads its pydantic schema by attribute
        self._instances: dict[str, dict] = {}

    async def create(self, instance_id=None, start=0, **kwargs):
        instance_id = instance_id or str(uuid4())
        self._instances[instance_id] = {"count": int(start), "calls": 0}
        EVENTS.append(("create", instance_id, int(start)))
        return instance_id, {"text": ""}

    async def execute(self, instance_id, parameters, **kwargs):
        state = self._instances[instance_id]       # a KeyError here would mean create was skipped
        step = parameters.get("step", 1)
        state["count"] += int(step) if isinstance(step, (int, float)) else 1
        state["calls"] += 1
        EVENTS.append(("execute", instance_id, state["calls"], state["count"]))
        return {"text": f"count={state['count']} (call {state['calls']})"}, 0.0, {"calls": state["calls"]}

    async def calc_reward(self, instance_id, **kwargs):
        EVENTS.append(("calc_reward", instance_id))
        return 0.1 * min(self._instances[instance_id]["calls"], 3)

    async def release(self, instance_id, **kwargs):
        EVENTS.append(("release", instance_id))
        del self._instances[instance_id]


class RetryInteraction:
    """verl BaseInteraction shape: a user who asks for another try `tries` times unless the answer is right."""

    def __init__(self, config: dict):
        self.config = config
        self.name = config.get("name", "retry")
        self._instances: dict[str, dict] = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id = instance_id or str(uuid4())
        self._instances[instance_id] = {"truth": str(ground_truth), "asked": 0, "right": False}
        EVENTS.append(("start_interaction", instance_id))
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        state = self._instances[instance_id]
        answer = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        state["right"] = state["truth"] in answer
        if state["right"]:
            return True, "Correct.", 1.0, {}
        if state["asked"] >= self.config.get("tries", 2):
            return True, "Out of tries.", 0.0, {}
        state["asked"] += 1
        return False, self.config.get("retry", "Not yet. Use the counter tool again, then give the count."), 0.0, {}

    async def calculate_score(self, instance_id, **kwargs):
        EVENTS.append(("calculate_score", instance_id))
        return 1.0 if self._instances[instance_id]["right"] else 0.0

    async def finalize_interaction(self, instance_id, **kwargs):
        EVENTS.append(("finalize_interaction", instance_id))
        del self._instances[instance_id]
