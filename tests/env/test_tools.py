"""Tools: schemas from functions, argument checks, the per-trajectory lifecycle and limits (loading by name:
test_loading.py)."""

import asyncio
import json
import textwrap
import threading
import time

import pytest

from turnrl.config.schema import ToolSpec
from turnrl.env.loading import tool_factory
from turnrl.env.tools import FunctionTool, ToolOutput, ToolSession, check_arguments, schema_from_function
from turnrl.ledger import ToolCall
from turnrl.rollout.loop import truncate_tokens


def run(coro):
    return asyncio.run(coro)


def add(a: int, b: float = 1.5, label: str = "sum", flags: list = None) -> str:
    """Add two numbers.

    Longer explanation that is not part of the summary.

    Args:
        a: the first number
        b (float): the second number
        label: what to call the result

    Returns:
        the labelled sum
    """
    return f"{label}={a + b}"


# -- schemas and argument checks ------------------------------------------------------------------------
def test_schema_from_function_reads_signature_and_google_docstring():
    schema = schema_from_function(add)
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "add"
    assert fn["description"] == "Add two numbers."
    props = fn["parameters"]["properties"]
    assert props["a"] == {"type": "integer", "description": "the first number"}
    assert props["b"] == {"type": "number", "description": "the second number"}
    assert props["label"] == {"type": "string", "description": "what to call the result"}
    assert props["flags"] == {"type": "array"}
    assert fn["parameters"]["required"] == ["a"]
    assert "Returns" not in props and "the labelled sum" not in json.dumps(props)


def test_schema_name_override_and_postponed_annotations():
    ns = {}
    exec(textwrap.dedent('''
        from __future__ import annotations
        def f(n: int, on: bool, x) -> str:
            "Do f."
            return ""
    '''), ns)
    schema = schema_from_function(ns["f"], name="renamed")
    props = schema["function"]["parameters"]["properties"]
    assert schema["function"]["name"] == "renamed"
    assert props == {"n": {"type": "integer"}, "on": {"type": "boolean"}, "x": {"type": "string"}}


def test_check_arguments_missing_unknown_and_types():
    schema = schema_from_function(add)
    assert check_arguments(schema, {"a": 1}) is None
    assert check_arguments(schema, {"a": 1, "b": 2}) is None          # an int is a JSON number
    assert "missing required argument(s): a" in check_arguments(schema, {"b": 2.0})
    msg = check_arguments(schema, {"a": 1, "c": 3})
    assert "unknown argument(s): c" in msg and "expected a, b, label, flags" in msg
    assert check_arguments(schema, {"a": "1"}) == "argument 'a' must be of type integer, got str"
    assert check_arguments(schema, {"a": True}) == "argument 'a' must be of type integer, got bool"
    assert check_arguments(schema, {"a": 1, "b": "x"}) == "argument 'b' must be of type number, got str"
    assert check_arguments(schema, {"a": 1, "flags": "x"}) == "argument 'flags' must be of type array, got str"


def test_check_arguments_schema_without_parameters_rejects_extra_arguments():
    """A function without parameters called with one is a policy error, not a crash of the tool."""
    def now() -> str:
        """The time."""
        return "noon"
    msg = check_arguments(schema_from_function(now), {"tz": "UTC"})
    assert msg == "unknown argument(s): tz; expected no arguments"
    open_schema = {"function": {"name": "x", "parameters": {"type": "object", "properties": {},
                                                             "additionalProperties": True}}}
    assert check_arguments(open_schema, {"anything": 1}) is None


# -- lifecycle ------------------------------------------------------------------------------------------
class Counter:
    """A stateful tool that records its lifecycle in a shared log."""
    name = "counter"
    schema = {"type": "function", "function": {"name": "counter", "description": "count",
              "parameters": {"type": "object", "properties": {"step": {"type": "integer"},
                                                              "fail": {"type": "boolean"}}}}}
    instances = []

    def __init__(self):
        self.log = []
        self.total = None
        Counter.instances.append(self)

    def create(self, start=0, **kwargs):
        self.log.append(("create", start))
        self.total = start

    def execute(self, args):
        if args.get("fail"):
            raise RuntimeError("asked to fail")
        self.total += args.get("step", 1)
        return ToolOutput(str(self.total), reward=0.5, metrics={"total": self.total})

    def reward(self):
        self.log.append(("reward", self.total))
        return self.total

    def release(self):
        self.log.append(("release",))


def call(name, args, i=0):
    return ToolCall(name, args, json.dumps({"name": name, "arguments": args}), f"call_{i}")


def test_session_lifecycle_state_persists_and_end_steps_run_once_even_after_errors():
    tool = Counter()
    session = ToolSession({"counter": tool}, {"counter": {"start": 10}})

    async def scenario():
        await session.create()
        first = await session.execute_all([call("counter", {"step": 2})])
        failed = await session.execute_all([call("counter", {"fail": True})])
        second = await session.execute_all([call("counter", {"step": 3})])
        rewards, errors = await session.rewards()
        release_errors = await session.release()
        return first, failed, second, rewards, errors, release_errors

    first, failed, second, rewards, errors, release_errors = run(scenario())
    assert [r.text for r in first] == ["12"] and first[0].reward == 0.5 and first[0].metrics == {"total": 12}
    assert failed[0].error == "tool 'counter' raised RuntimeError: asked to fail"
    assert failed[0].blame == "environment" and failed[0].text.startswith("Error: ")
    assert second[0].text == "15"                        # the state survived the failed call
    assert rewards == {"counter": 15.0} and errors == [] and release_errors == []
    assert tool.log == [("create", 10), ("reward", 15), ("release",)]


def test_factories_give_each_trajectory_its_own_instance():
    _, make = tool_factory(ToolSpec(class_name=f"{__name__}:Counter"))
    a, b = make(), make()
    assert a is not b
    sa, sb = ToolSession({"counter": a}, {"counter": {"start": 0}}), ToolSession({"counter": b}, {"counter": {"start": 100}})

    async def both():
        await asyncio.gather(sa.create(), sb.create())
        ra = await sa.execute_all([call("counter", {"step": 1})])
        rb = await sb.execute_all([call("counter", {"step": 1})])
        return ra[0].text, rb[0].text
    assert run(both()) == ("1", "101")


def test_policy_errors_are_blamed_on_the_policy():
    session = ToolSession({"counter": Counter()})
    bad_json = ToolCall("", None, "<tool_call>{oops</tool_call>", "call_0", error="malformed JSON in <tool_call>")

    async def scenario():
        await session.create()
        return await session.execute_all([bad_json, call("nope", {}), call("counter", {"step": "two"})])
    results = run(scenario())
    assert [r.blame for r in results] == ["policy"] * 3
    assert results[0].error == "malformed JSON in <tool_call>"
    assert results[1].error == "unknown tool 'nope'; available tools: counter"
    assert results[2].error == "argument 'step' must be of type integer, got str"
    assert all(r.text == f"Error: {r.error}" for r in results)


def test_create_failure_and_missing_lifecycle_methods():
    class Minimal:  # only the required parts: name, schema, execute
        name = "minimal"
        schema = {"type": "function", "function": {"name": "minimal", "parameters": {"type": "object", "properties": {}}}}

        def execute(self, args):
            return "ok"

    class BrokenStart(Counter):
        def create(self, **kwargs):
            raise KeyError("ground_truth")

    session = ToolSession({"minimal": Minimal(), "broken": BrokenStart()})

    async def scenario():
        await session.create()
        results = await session.execute_all([call("minimal", {}), call("broken", {})])
        return results, await session.rewards(), await session.release()
    results, (rewards, reward_errors), release_errors = run(scenario())
    assert session.create_errors == {"broken": "KeyError: 'ground_truth'"}
    assert results[0].text == "ok" and results[0].error is None
    assert results[1].error == "tool failed to start: KeyError: 'ground_truth'"
    assert results[1].blame == "environment"
    assert reward_errors == [] and release_errors == []


def test_sync_async_and_verl_tuple_returns():
    class Async:
        name = "a"
        schema = {"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {}}}}

        async def execute(self, args):
            await asyncio.sleep(0)
            return ("verl text", 0.25, {"k": 1})

    class ResponseObject:  # verl >= 0.5 returns a ToolResponse object with a .text field
        text = "from an object"

    class Obj(Async):
        name = "o"

        async def execute(self, args):
            return (ResponseObject(), 1, None)

    def plain(x: int) -> int:
        """Square."""
        return x * x

    session = ToolSession({"a": Async(), "o": Obj(), "plain": FunctionTool(plain)})

    async def scenario():
        await session.create()
        return await session.execute_all([call("a", {}), call("o", {}), call("plain", {"x": 7})])
    a, o, p = run(scenario())
    assert (a.text, a.reward, a.metrics) == ("verl text", 0.25, {"k": 1})
    assert (o.text, o.reward) == ("from an object", 1.0)
    assert (p.text, p.reward, p.error) == ("49", None, None)


def test_reward_that_is_not_a_number_is_an_error_not_a_crash():
    class Odd(Counter):
        def reward(self):
            return "lots"
    session = ToolSession({"odd": Odd()})

    async def scenario():
        await session.create()
        return await session.rewards()
    rewards, errors = run(scenario())
    assert rewards == {} and len(errors) == 1 and errors[0].startswith("odd.reward() failed: ValueError")


def test_parallel_calls_are_bounded_by_max_parallel():
    active, peak, lock = [0], [0], threading.Lock()

    def slow(i: int) -> str:
        """Slow."""
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        return str(i)

    session = ToolSession({"slow": FunctionTool(slow)}, max_parallel=2)

    async def scenario():
        await session.create()
        return await session.execute_all([call("slow", {"i": i}, i) for i in range(6)])
    results = run(scenario())
    assert [r.text for r in results] == [str(i) for i in range(6)]     # order kept
    assert [r.call_id for r in results] == [f"call_{i}" for i in range(6)]
    assert peak[0] == 2


def test_many_concurrent_sync_tools_do_not_queue_into_their_timeouts():
    """40 trajectories call a 0.4 s sync tool at once: each call gets a thread, none waits out its 1.5 s."""
    def lookup(key: str) -> str:
        """Slow lookup."""
        time.sleep(0.4)
        return key.upper()

    sessions = [ToolSession({"lookup": FunctionTool(lookup)}, timeout_s=1.5) for _ in range(40)]

    async def scenario():
        t0 = time.perf_counter()
        results = await asyncio.gather(*(s.execute_all([call("lookup", {"key": f"k{i}"})])
                                         for i, s in enumerate(sessions)))
        return [r for rs in results for r in rs], time.perf_counter() - t0
    results, seconds = run(scenario())
    assert [r.error for r in results] == [None] * 40
    assert [r.text for r in results] == [f"K{i}" for i in range(40)] and seconds < 1.4


def test_per_call_timeout_is_an_environment_error():
    async def hang() -> str:
        """Hang."""
        await asyncio.sleep(30)
        return "never"

    session = ToolSession({"hang": FunctionTool(hang)}, timeout_s=0.2)

    async def scenario():
        await session.create()
        t0 = time.perf_counter()
        results = await session.execute_all([call("hang", {})])
        return results, time.perf_counter() - t0
    (result,), seconds = run(scenario())
    assert result.error == "tool 'hang' timed out after 0.2s" and result.blame == "environment"
    assert seconds < 2 and result.seconds >= 0.2


def test_huge_error_text_is_truncated_like_output():
    def explode() -> str:
        """Explode."""
        raise ValueError("x" * 10_000)

    session = ToolSession({"explode": FunctionTool(explode)},
                          truncate=lambda text: (text[:50], True) if len(text) > 50 else (text, False))

    async def scenario():
        await session.create()
        return await session.execute_all([call("explode", {})])
    (result,) = run(scenario())
    assert len(result.text) == 50 and result.truncated and len(result.error) > 10_000


# -- truncation by tokens -------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["head", "tail", "middle"])
def test_truncate_tokens_keeps_the_right_part_within_the_limit(smol_template, side):
    template = smol_template
    text = " ".join(f"w{i}" for i in range(400))
    n = len(template.encode(text))
    out, truncated = truncate_tokens(template, text, 64, side)
    assert truncated and len(template.encode(out)) <= 64
    assert "tokens truncated]..." in out
    dropped = int(out.split("...[")[1].split(" tokens")[0])
    kept = out.replace(f"...[{dropped} tokens truncated]...", "")
    assert len(template.encode(kept)) == n - dropped
    if side == "head":
        assert out.endswith("w399") and "w0 " not in out
    elif side == "tail":
        assert out.startswith("w0 ") and "w399" not in out
    else:
        assert out.startswith("w0 ") and out.endswith("w399") and "w200" not in out


def test_truncate_tokens_leaves_short_text_alone(smol_template):
    template = smol_template
    assert truncate_tokens(template, "42", 64, "middle") == ("42", False)
    with pytest.raises(ValueError, match="truncate side"):
        truncate_tokens(template, "x " * 100, 10, "left")
