"""`turnrl rollout`: run the configured tasks through the agent loop and save the trajectories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from turnrl.config import Config, dump_yaml
from turnrl.data import load_dataset
from turnrl.ledger import Source
from turnrl.llm import close_all as close_llm_clients
from turnrl.models import resolve
from turnrl.observe.progress import Progress
from turnrl.observe.store import write_trajectories
from turnrl.rewards.collab import RolloutContext, conversation_reward
from turnrl.rewards.functions import RewardFunction, bind_rollout, load_reward_function, score_all
from turnrl.rollout.factory import build_engine, build_environment, build_loop, load_template
from turnrl.rollout.scheduler import Timer, run_batch, summarize


def reward_functions(cfg: Config) -> list[Any]:
    """The configured functions, then the LLM judge (part `judge`) when `reward.judge` is set."""
    weights = cfg.reward.weights or [1.0] * len(cfg.reward.functions)
    kwargs = cfg.reward.function_kwargs or [{}] * len(cfg.reward.functions)
    functions = [load_reward_function(name, w, kw) for name, w, kw in zip(cfg.reward.functions, weights, kwargs)]
    if cfg.reward.judge is not None:
        functions.append(RewardFunction("judge", conversation_reward(cfg.reward.judge), cfg.reward.judge.weight))
    return functions


async def rollout_to_dir(cfg: Config, out: Path, limit: int | None = None, min_reward: float | None = None
                         ) -> dict[str, Any]:
    d = cfg.data.train
    tasks = load_dataset(d.path, d.task, d.size, d.seed, d.options, d.max_rows)[:limit]
    model_path = resolve(cfg.model.name)
    template = load_template(model_path)
    env = build_environment(cfg.rollout)
    functions = reward_functions(cfg)
    engine = build_engine(cfg.engine, model_path)
    bind_rollout(functions, RolloutContext(engine, template, env, cfg.rollout, cfg.seed))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_yaml(cfg))
    progress = Progress(len(tasks) * cfg.rollout.n, "rollout", cfg.logging.progress,
                        in_flight=lambda: getattr(engine, "in_flight", 0))
    try:
        loop = build_loop(cfg.rollout, engine, template, env, cfg.seed)
        timer = Timer()
        trajectories = await run_batch(loop, tasks, cfg.rollout.n, cfg.rollout.concurrency,
                                       on_done=lambda t: progress.update(1, tokens=t.n_tokens(Source.POLICY)))
        seconds = timer.seconds
        await score_all(trajectories, functions, cfg.reward.use_tool_rewards, cfg.reward.use_interaction_rewards)
    finally:
        progress.close()
        await engine.close()
        await close_llm_clients()
    write_trajectories(out / "trajectories.jsonl", trajectories)
    summary = summarize(trajectories, seconds)
    if min_reward is not None:
        accepted = [t for t in trajectories if t.reward >= min_reward and not t.masked]
        write_trajectories(out / "accepted.jsonl", accepted)
        summary["accepted"] = len(accepted)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
