"""An OpenAI Agents SDK agent: a `function_tool` calculator and the SDK's chat-completions model on the session's
client. The task's worked example goes in as the SDK's own input items (a function call and its output)."""

import json
import re
import sys
from pathlib import Path

from agents import Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import calculator_tool  # noqa: E402

set_tracing_disabled(True)   # offline: no traces uploaded
CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses."""
    return calculator_tool.calculator(expression)


def as_items(messages):
    """Chat messages -> Agents SDK input items (tool calls written as text become function_call items)."""
    items, last_call = [], None
    for i, m in enumerate(messages):
        found = CALL.search(m["content"]) if m["role"] == "assistant" else None
        if found:
            call = json.loads(found.group(1))
            last_call = f"demo_{i}"
            items.append({"type": "function_call", "call_id": last_call, "name": call["name"],
                          "arguments": json.dumps(call["arguments"])})
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": last_call, "output": m["content"]})
        else:
            items.append({"role": m["role"], "content": m["content"]})
    return items


async def run(row, client):
    system = [m["content"] for m in row["messages"] if m["role"] == "system"]
    agent = Agent(name="calculator", instructions=system[0] if system else None, tools=[calculator],
                  model=OpenAIChatCompletionsModel(model=row["model"], openai_client=client))
    rest = [m for m in row["messages"] if m["role"] != "system"]
    try:
        result = await Runner.run(agent, input=as_items(rest), max_turns=4)
    except MaxTurnsExceeded:   # the policy kept calling tools: a wrong answer, not a broken environment
        return 0.0
    return calculator_tool.exact_reward(str(result.final_output), row["ground_truth"])
