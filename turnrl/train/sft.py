"""`turnrl sft`: supervised fine-tuning on multi-turn conversations, and rejection sampling (RFT) rounds.

Conversations go through the same chat layer and ledger as rollouts (`replay_conversation`): each
assistant message becomes policy tokens (its tokens plus the end-of-turn token), everything else is
appended as template/tool/user deltas. So the loss mask covers exactly the assistant tokens, and a
conversation gets the same token ids here as in a rollout ledger. Trajectories saved by rollouts (e.g.
`turnrl rollout --min-reward 1` -> accepted.jsonl) are used as they are, token for token.

Rows can come from: a JSONL/Parquet of chat conversations (`messages` with assistant turns; structured
`tool_calls` are written as hermes `<tool_call>` text), trajectory files, or a built-in task's generated
demonstrations. Micro-batches follow a token budget (longest first, each cut to its own length). Loss:
token-mean negative log-likelihood over the mini-batch. The merged final model is written as a plain
Hugging Face directory that `model.name` can point to for RL.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from turnrl.algo.losses import aggregate
from turnrl.chat.parity import replay_conversation
from turnrl.chat.templates import ChatTemplate
from turnrl.config import Config
from turnrl.data import Task, load_dataset
from turnrl.ledger import Trajectory
from turnrl.observe.store import read_trajectories
from turnrl.rollout.factory import build_environment
from turnrl.train.batching import micro_batches, to_rows
from turnrl.train.optim import clip_and_step
from turnrl.train.policy import forward_logprobs


def with_text_tool_calls(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message whose structured `tool_calls` are appended to its content as hermes text."""
    calls = message.get("tool_calls")
    if not calls:
        return {k: v for k, v in message.items() if k != "tool_calls"}
    parts = [message.get("content") or ""]
    for call in calls:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        parts.append("<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}) + "\n</tool_call>")
    content = "\n".join(p for p in parts if p)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}


def task_conversation(task: Task) -> tuple[list[dict[str, Any]], int | None] | None:
    """(conversation, prompt length) to learn from. With a demonstration, the task's messages are the prompt
    (few-shot examples in it are not trained on); without, the row's own assistant turns are the targets."""
    messages = list(task.messages) + list(task.demonstration or [])
    prompt_len = len(task.messages) if task.demonstration else None
    if not any(m["role"] == "assistant" for m in messages[prompt_len or 0:]):
        return None
    return [with_text_tool_calls(m) if m["role"] == "assistant" else m for m in messages], prompt_len


def examples_from_tasks(tasks: list[Task], template: ChatTemplate, schemas: dict[str, dict[str, Any]]
                        ) -> tuple[list[Trajectory], int]:
    """Trajectories whose loss mask is exactly the assistant tokens; (examples, skipped)."""
    out, skipped = [], 0
    for task in tasks:
        found = task_conversation(task)
        if found is None:
            skipped += 1
            continue
        conversation, prompt_len = found
        names = list(schemas) if task.tools is None else task.tools
        tools = [schemas[n] for n in names if n in schemas]
        report, traj = replay_conversation(template, conversation, tools, name=task.uid, prompt_len=prompt_len)
        if report.result in ("exact", "token_drift", "split"):
            out.append(traj)
        else:
            skipped += 1
    return out, skipped


def load_examples(cfg: Config, template: ChatTemplate) -> tuple[list[Trajectory], int]:
    d = cfg.data.train
    if d.path is not None and _is_trajectory_file(Path(d.path)):
        trajs = [t for t, _ in read_trajectories(Path(d.path)) if not t.masked]
        return trajs[: d.max_rows] if d.max_rows else trajs, 0
    tasks = load_dataset(d.path, d.task, d.size, d.seed, d.options, d.max_rows)
    env = build_environment(cfg.rollout)
    schemas = {name: make().schema for name, make in env.tool_factories.items()
               if any(t.tools is None or name in t.tools for t in tasks)}
    return examples_from_tasks(tasks, template, schemas)


def _is_trajectory_file(path: Path) -> bool:
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    return bool(first.strip()) and "segments" in json.loads(first)


def sft_epoch(model: Any, optimizer: torch.optim.Optimizer, scheduler: Any, examples: list[Trajectory],
              batch_size: int, micro_batch_tokens: int, grad_clip: float, amp: torch.dtype | None,
              device: torch.device, order_seed: int, pad_id: int, skip_batches: int = 0,
              on_step: Any = None, params: list[torch.nn.Parameter] | None = None) -> None:
    """One pass over `examples` in the order drawn from `order_seed` (so a resumed epoch sees the same
    order); `on_step(batch_index, metrics)` after each optimizer step. `params`: what the optimizer steps and
    the gradient clipping sees (default the model's trainable parameters; the fp32 masters with
    `turnrl.train.master.MasterWeights`)."""
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(order_seed)).tolist()
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    for b, start in enumerate(range(0, len(order), batch_size)):
        if b < skip_batches:
            continue
        t0 = time.perf_counter()
        chunk = [examples[i] for i in order[start:start + batch_size]]
        batch = to_rows(chunk, pad_id=pad_id)
        ids, attn = batch.input_ids.to(device), batch.attention_mask.to(device)
        pos, mask = batch.position_ids.to(device), batch.loss_mask.to(device)
        normalizer = float(mask.sum())
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        lengths = attn.sum(1).cpu()
        for index, width in micro_batches(torch.arange(len(chunk)), lengths, micro_batch_tokens):
            index = index.to(device)
            lp, _ = forward_logprobs(model, ids[index, :width], attn[index, :width], pos[index, :width], 1.0, amp)
            loss = aggregate(-lp.float(), mask[index, :width], "token-mean", normalizer)
            loss.backward()
            total += float(loss.detach())
        grad_norm = clip_and_step(optimizer, params, grad_clip)
        scheduler.step()
        if on_step is not None:
            on_step(b, {"sft/loss": total, "sft/tokens": normalizer, "grad_norm": float(grad_norm),
                        "lr": scheduler.get_last_lr()[0], "time/step_s": time.perf_counter() - t0,
                        "throughput/train_tokens_per_s": float(attn.sum()) / max(time.perf_counter() - t0, 1e-9)})
