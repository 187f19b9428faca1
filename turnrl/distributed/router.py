"""The router now lives in `turnrl.engines.router` (pure, no Ray: the vLLM server engine uses it too, and
engines must not import `distributed`). Re-exported here for existing imports."""

from turnrl.engines.router import Pool, ReplicaDied, ReplicaState, Router, RouterStats  # noqa: F401
