"""The configured reward functions: `reward.functions` (with their weights and kwargs), then the LLM judge
(part `judge`) when `reward.judge` is set. The judge's CollabLLM futures sample from the policy: pass its
`RolloutContext` (none: a judge with num_repeat_rollouts > 0 records an error on each trajectory)."""

from __future__ import annotations

from turnrl.config import Config
from turnrl.rewards.collab import RolloutContext, conversation_reward
from turnrl.rewards.functions import RewardFunction, load_reward_function


def reward_functions(cfg: Config, context: RolloutContext | None = None) -> list[RewardFunction]:
    weights = cfg.reward.weights or [1.0] * len(cfg.reward.functions)
    kwargs = cfg.reward.function_kwargs or [{}] * len(cfg.reward.functions)
    functions = [load_reward_function(name, w, kw) for name, w, kw in zip(cfg.reward.functions, weights, kwargs)]
    if cfg.reward.judge is not None:
        functions.append(RewardFunction("judge", conversation_reward(cfg.reward.judge, context),
                                        cfg.reward.judge.weight))
    return functions
