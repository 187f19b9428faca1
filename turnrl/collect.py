"""`turnrl rollout` (and RFT's collection rounds): run the configured tasks through the agent loop, score them
and save the trajectories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from turnrl.config import Config, ConfigError, dump_yaml
from turnrl.data import load_dataset
from turnrl.engines.logs import route_engine_logs
from turnrl.ledger import Source
from turnrl.llm import close_all as close_llm_clients
from turnrl.models import resolve
from turnrl.observe.progress import Progress
from turnrl.observe.store import write_trajectories
from turnrl.rewards.build import reward_functions
from turnrl.rewards.collab import RolloutContext
from turnrl.rewards.functions import score_all
from turnrl.rollout.factory import build_engine, build_environment, build_loop, load_template
from turnrl.rollout.scheduler import Timer, run_batch, summarize


async def rollout_to_dir(cfg: Config, out: Path, limit: int | None = None, min_reward: float | None = None
                         ) -> dict[str, Any]:
    if cfg.agent is not None:
        raise ConfigError("turnrl rollout runs the built-in agent loop; an 'agent:' config rolls out in turnrl train "
                         "(or serve it: turnrl serve CFG --record DIR, and run your agent against it).")
    d = cfg.data.train
    tasks = load_dataset(d.path, d.task, d.size, d.seed, d.options, d.max_rows)[:limit]
    model_path = resolve(cfg.model.name)
    template = load_template(model_path, cfg.model.chat_template, cfg.model.chat_template_kwargs)
    env = build_environment(cfg.rollout)
    route_engine_logs(cfg.engine.kind, out, cfg.logging.engine_logs)
    engine = build_engine(cfg.engine, model_path)
    functions = reward_functions(cfg, RolloutContext(engine, template, env, cfg.rollout, cfg.seed))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_yaml(cfg))
    progress = Progress(len(tasks) * cfg.rollout.n, "rollout", cfg.logging.progress,
                        in_flight=lambda: engine.in_flight)
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
