"""A LangGraph tool-calling agent (langchain-openai's ChatOpenAI + langgraph's prebuilt ReAct graph).

The graph is built as anyone would build it; only the model's base URL is the session's. It returns the reward
(exact answer), so no reward function is needed.
"""

import sys
from pathlib import Path

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import calculator_tool  # noqa: E402


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses."""
    return calculator_tool.calculator(expression)


async def run(row, client):
    llm = ChatOpenAI(model=row["model"], base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    graph = create_react_agent(llm, [calculator])
    state = await graph.ainvoke({"messages": calculator_tool.with_call_ids(row["messages"])},
                                {"recursion_limit": 7})
    return calculator_tool.exact_reward(state["messages"][-1].content, row["ground_truth"])
