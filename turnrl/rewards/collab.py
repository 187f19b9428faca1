"""The conversation-level reward of CollabLLM (Wu et al., 2025, "CollabLLM: From Passive Responders to Active
Collaborators"), with the plain LLM-judge reward as its case without futures.

For a trajectory, take conversations c_1..c_R: with `num_repeat_rollouts` R > 0, R futures of it (the policy
and the row's simulated user go on alternating for up to `max_future_turns` assistant turns); with R = 0,
the trajectory itself. Each conversation gets every metric (judged by the LLM judge, or computed:
token_amount, bleu, pass_rate), and

    reward = sum over metrics m of clamp(w_m * mean_j m(c_j), -1, 1)

as in the paper and verl's recipe. Deviations, each on purpose:
- token_amount counts the policy's tokens (the trajectory's and the future's), not whitespace words;
- the futures start from the trajectory's last recorded user reply (the agent loop always asks the user after
  the last assistant turn), so all R futures share one prefix: the same prompt ids reach the engine together
  (one batched prefill; vLLM's prefix cache keeps it), and no user call is spent to re-sample that reply. A
  trajectory the user ended (`interaction_done`), one without a simulated user, or one whose last turn got no
  reply is complete: it is its own single conversation;
- an unknown metric is a config error (verl scores it 0 and prints a line);
- a judge that fails on any conversation, or futures that all fail, make the reward an error that masks the
  sample (`judge` in the trajectory's errors), never a zero; a future that fails (engine or user error) is
  left out of the mean and counted.
Futures are sampled from the policy's engine with the rollout's sampling, are never trained on (they are
not in the batch), run concurrently, and have no tools (CollabLLM's are conversations). Their new messages
are kept in `traj.metrics['judge_futures']`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

from turnrl.chat.templates import ChatTemplate
from turnrl.config.schema import JudgeConfig, RolloutConfig
from turnrl.data.rows import Task
from turnrl.engines.base import Engine
from turnrl.env.interactions import last_assistant_text
from turnrl.ledger import Source, Trajectory
from turnrl.llm.client import Usage
from turnrl.llm.pool import client
from turnrl.rewards.functions import RewardError
from turnrl.rewards.judge import COMPUTED_METRICS, JUDGED_METRICS, Judge, JudgeError, Verdict, load_rubric
from turnrl.rewards.measures import bleu, pass_rate, tests_of
from turnrl.rollout.factory import build_loop
from turnrl.rollout.loop import AgentLoop, Environment, rollout_seed


@dataclass
class RolloutContext:
    """What futures are rolled out with: the policy's engine, its chat template, the environment and config."""
    engine: Engine
    template: ChatTemplate
    env: Environment
    rollout: RolloutConfig
    seed: int = 0

    def loop(self, max_turns: int, policy_version: int) -> AgentLoop:
        cfg = dataclasses.replace(self.rollout, max_assistant_turns=max_turns, max_user_turns=max_turns)
        return build_loop(cfg, self.engine, self.template, self.env, rollout_seed(self.seed, policy_version),
                          policy_version=policy_version)


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    policy_tokens: int
    turns: int = 0                      # assistant turns the future added


class ConversationReward:
    """The `judge` reward function: call it on a finished trajectory. `context`: the policy futures are sampled
    from (needed with num_repeat_rollouts > 0)."""

    def __init__(self, weights: dict[str, float], judge: Judge | None = None, num_repeat_rollouts: int = 0,
                 max_future_turns: int = 2, pass_timeout_s: float = 10.0, context: RolloutContext | None = None):
        self.weights = weights
        self.judge = judge
        self.num_repeat_rollouts = num_repeat_rollouts
        self.max_future_turns = max_future_turns
        self.pass_timeout_s = pass_timeout_s
        self.context = context

    async def __call__(self, traj: Trajectory) -> dict[str, float]:
        if traj.masked:  # its rollout already failed: it is out of the loss, a judge call would be wasted
            return {"score": 0.0, "skipped": 1.0}
        conversations, sampled, failed = await self._conversations(traj)
        rows = await asyncio.gather(*(self._measure(c, traj.info) for c in conversations), return_exceptions=True)
        usage, parse_failures = Usage(), 0
        for row in rows:
            verdict = row[1] if isinstance(row, tuple) else row if isinstance(row, JudgeError) else None
            if verdict is not None:
                usage.add(verdict.usage)
                parse_failures += verdict.parse_failures
        costs = self._costs(usage, parse_failures, sampled, failed)
        for row in rows:
            if isinstance(row, JudgeError):
                raise RewardError("judge", f"judge failed: {row}", costs)
            if isinstance(row, BaseException):
                raise row
        means = {m: sum(row[0][m] for row in rows) / len(rows) for m in self.weights}
        score = sum(max(-1.0, min(1.0, w * means[m])) for m, w in self.weights.items())
        turns = sum(c.turns for c in conversations) / len(conversations) if sampled else 0.0
        return {"score": score, **means, **costs, "future_turns": turns}

    def _costs(self, usage: Usage, parse_failures: int, sampled: int, failed: int) -> dict[str, float]:
        out = {"futures": float(sampled), "failed_futures": float(failed)}
        if self.judge is not None:
            out.update({"requests": float(usage.requests), "prompt_tokens": float(usage.prompt_tokens),
                        "completion_tokens": float(usage.completion_tokens),
                        "tokens": float(usage.prompt_tokens + usage.completion_tokens),
                        "cache_hits": float(usage.cache_hits), "retries": float(usage.retries),
                        "parse_failures": float(parse_failures), "seconds": usage.seconds})
        return out

    async def _measure(self, conv: Conversation, info: dict[str, Any]) -> tuple[dict[str, float], Verdict]:
        verdict = Verdict({})
        if self.judge is not None:
            verdict = await self.judge.score(conv.messages, info)
        scores = dict(verdict.scores)
        if "token_amount" in self.weights:
            scores["token_amount"] = float(conv.policy_tokens)
        if "bleu" in self.weights:
            truth = info.get("ground_truth")
            if truth is None:
                raise ValueError("bleu needs the row's ground_truth (the reference text)")
            scores["bleu"] = bleu(last_assistant_text(conv.messages), str(truth))
        if "pass_rate" in self.weights:
            scores["pass_rate"] = await pass_rate(last_assistant_text(conv.messages), tests_of(info),
                                                  self.pass_timeout_s)
        return scores, verdict

    async def _conversations(self, traj: Trajectory) -> tuple[list[Conversation], int, int]:
        """(conversations to score, futures sampled, futures failed)."""
        itself = [Conversation(list(traj.messages), traj.n_tokens(Source.POLICY))]
        interaction = traj.info.get("interaction")
        last = traj.turns[-1] if traj.turns else None
        if (self.num_repeat_rollouts == 0 or not interaction or traj.termination == "interaction_done"
                or last is None or last.user_reply is None):
            return itself, 0, 0
        if self.context is None:
            raise RewardError("judge", "num_repeat_rollouts > 0 needs the policy's engine to sample futures, and "
                                       "this reward was built without one (context=None): here, set num_repeat_rollouts=0")
        task = Task(uid=f"{traj.group_id}~{traj.sample_index}~future", tools=[], interaction=dict(interaction),
                    messages=[*traj.messages, {"role": "user", "content": last.user_reply}],
                    ground_truth=traj.info.get("ground_truth"), data_source=str(traj.info.get("data_source", "")),
                    extra=dict(traj.info.get("extra") or {}), index=int(traj.info.get("index") or 0))
        loop = self.context.loop(self.max_future_turns, traj.policy_version)
        futures = await asyncio.gather(*(loop.run(task, k) for k in range(self.num_repeat_rollouts)))
        good = [f for f in futures if not f.masked and f.turns]
        traj.metrics["judge_futures"] = [f.messages[len(task.messages):] for f in futures]
        if not good:
            first = next((e for f in futures for e in f.errors), None)
            raise RewardError("judge", f"all {len(futures)} futures failed: "
                                       f"{first.kind + ': ' + first.message if first else 'no assistant turn'}",
                              {"futures": float(len(futures)), "failed_futures": float(len(futures))})
        base = traj.n_tokens(Source.POLICY)
        return ([Conversation(f.messages, base + f.n_tokens(Source.POLICY), len(f.turns)) for f in good],
                len(futures), len(futures) - len(good))


def conversation_reward(cfg: JudgeConfig, context: RolloutContext | None = None) -> ConversationReward:
    """The reward a `reward.judge` section describes (its LLM client is shared through turnrl.llm.pool);
    `context`: the policy that samples CollabLLM futures."""
    judged = {m: JUDGED_METRICS.get(m) or cfg.metrics[m] for m in cfg.metric_weights if m not in COMPUTED_METRICS}
    judge = None
    if judged:
        judge = Judge(client(cfg.llm, "judge"), judged, load_rubric(cfg.rubric), cfg.json_prefill, cfg.parse_retries,
                      cfg.max_conversation_chars)
    return ConversationReward(dict(cfg.metric_weights), judge, cfg.num_repeat_rollouts, cfg.max_future_turns,
                              cfg.pass_timeout_s, context)
