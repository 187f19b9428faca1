"""A plain `openai` SDK tool-calling agent: ask, run the calculator calls, send the results back, repeat.

turnrl calls `run(row, client)` once per session with an `openai.AsyncOpenAI` whose base URL is the session's;
this agent returns nothing, and `reward.functions` score the recorded conversation (see train.yaml).
Run it against any OpenAI-compatible server the same way: `await run(row, openai.AsyncOpenAI())`.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from calculator_tool import SCHEMA, calculator  # noqa: E402

MAX_STEPS = 3


async def run(row, client):
    messages = list(row["messages"])
    for _ in range(MAX_STEPS):
        response = await client.chat.completions.create(model=row["model"], messages=messages, tools=[SCHEMA])
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
                result = calculator(str(expression))
            except (ValueError, AttributeError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
