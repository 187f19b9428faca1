"""Rollout: the agent loop (one coroutine per trajectory) and the scheduler that runs a batch of them."""
