"""A pydantic-ai agent: `OpenAIChatModel` on the session's client, a plain tool, the worked example as
pydantic-ai message history."""

import json
import re
import sys
from pathlib import Path

from pydantic_ai import Agent
from pydantic_ai.exceptions import UnexpectedModelBehavior, UsageLimitExceeded
from pydantic_ai.messages import (ModelRequest, ModelResponse, SystemPromptPart, TextPart, ToolCallPart, ToolReturnPart,
                                  UserPromptPart)
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import calculator_tool  # noqa: E402

CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses."""
    return calculator_tool.calculator(expression)


def history(messages):
    """All but the last user message, as pydantic-ai messages."""
    out, last_call = [], None
    for i, m in enumerate(messages):
        if m["role"] == "system":
            out.append(ModelRequest(parts=[SystemPromptPart(m["content"])]))
        elif m["role"] == "user":
            out.append(ModelRequest(parts=[UserPromptPart(m["content"])]))
        elif m["role"] == "tool":
            out.append(ModelRequest(parts=[ToolReturnPart(m.get("name", "calculator"), m["content"], tool_call_id=last_call)]))
        else:
            found = CALL.search(m["content"])
            if found:
                call, last_call = json.loads(found.group(1)), f"demo_{i}"
                out.append(ModelResponse(parts=[ToolCallPart(call["name"], call["arguments"], tool_call_id=last_call)]))
            else:
                out.append(ModelResponse(parts=[TextPart(m["content"])]))
    return out


async def run(row, client):
    model = OpenAIChatModel(row["model"], provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, tools=[calculator], retries=1)
    *past, question = row["messages"]
    try:
        result = await agent.run(question["content"], message_history=history(past),
                                 usage_limits=UsageLimits(request_limit=4))
    except (UsageLimitExceeded, UnexpectedModelBehavior):   # the policy's failure: a zero, not an error
        return 0.0
    return calculator_tool.exact_reward(result.output, row["ground_truth"])
