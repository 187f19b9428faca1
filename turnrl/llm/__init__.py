"""LLM clients for judges and simulated users: OpenAI-compatible endpoints or frozen local engines."""

from turnrl.llm.client import ChatResult, LLMClient, LLMError, Usage
from turnrl.llm.pool import client, close_all, usage_metrics

__all__ = ["ChatResult", "LLMClient", "LLMError", "Usage", "client", "close_all", "usage_metrics"]
