"""Small agents for the agent-rollout tests (imported by entrypoint name)."""

import asyncio
import json
import os
import sys


async def answer_once(row, client):
    r = await client.chat.completions.create(model=row["model"], messages=row["messages"])
    return 1.0 if "391" in (r.choices[0].message.content or "") else 0.25


def sync_agent(row, client):   # a plain def: runs in a thread with a sync client
    r = client.chat.completions.create(model=row["model"], messages=row["messages"])
    return float(len(r.choices[0].message.content or "") > 0)


async def crashes(row, client):
    await client.chat.completions.create(model=row["model"], messages=row["messages"])
    raise RuntimeError("the agent's framework fell over")


async def hangs(row, client):
    await asyncio.sleep(60)


async def returns_text(row, client):
    await client.chat.completions.create(model=row["model"], messages=row["messages"])
    return "great"


def command_main():
    """`python agents_for_tests.py`: an agent in another process, told everything by its environment."""
    import openai
    task = json.loads(os.environ["TURNRL_TASK"])
    client = openai.OpenAI()   # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    r = client.chat.completions.create(model=os.environ["TURNRL_MODEL"], messages=task["messages"])
    print("some log line")
    print(json.dumps({"reward": 0.5 if r.choices[0].message.content else 0.0}))


if __name__ == "__main__":
    sys.exit(command_main())
