"""One trajectory as the viewer page shows it: the conversation turn by turn, rewards, and every token.

Token text comes from the run's own tokenizer (`model.name` in the run directory's config.yaml), each id
decoded on its own; a multi-byte character split over two tokens therefore shows as two replacement marks,
which is what those tokens are. When the model cannot be resolved the page shows ids instead of text.
The trainer's logprobs (`metrics['trainer_logprobs']`, saved by the trainer for the last segment) sit next
to the engine's so the page can show their mismatch per token.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from turnrl.ledger import Source, Trajectory
from turnrl.observe.conversation import split_messages

# One colour per token source, and the underline that marks tokens inside the loss mask. The page's CSS is
# generated from these, and the browser test checks the rendered colours against them.
SOURCE_COLOURS = {Source.PROMPT: "#dce6f2", Source.POLICY: "#c6efc6", Source.TOOL: "#ffe0b0",
                  Source.USER: "#ead7f7", Source.TEMPLATE: "#e4e4e4"}
MASK_COLOUR = "#0b6e2a"


def source_css() -> str:
    lines = [f'.tok[data-source="{int(s)}"] {{ background-color: {c}; }}' for s, c in SOURCE_COLOURS.items()]
    lines.append(f'.tok[data-mask="1"], .chip.trained {{ border-bottom-color: {MASK_COLOUR}; }}')
    lines += [f'.chip-{s.name.lower()} {{ background-color: {c}; }}' for s, c in SOURCE_COLOURS.items()]
    return "\n".join(lines)


class TokenText:
    """id -> text with the run's tokenizer, cached; `None` texts when no tokenizer could be loaded."""

    def __init__(self, run_dir: Path):
        self.cache: dict[int, str] = {}
        self.model, self.tokenizer, self.problem = "", None, ""
        try:
            import yaml
            config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
            self.model = str((config.get("model") or {}).get("name") or "")
            if not self.model:
                raise ValueError("config.yaml has no model.name")
            from transformers import AutoTokenizer

            from turnrl.models import resolve
            self.tokenizer = AutoTokenizer.from_pretrained(str(resolve(self.model)))
        except Exception as exc:  # noqa: BLE001 - the viewer still works, with ids instead of text
            self.problem = f"{type(exc).__name__}: {exc}"
            print(f"[turnrl] view: showing token ids, not text (no tokenizer: {self.problem})", file=sys.stderr)

    def texts(self, ids: list[int]) -> list[str] | None:
        if self.tokenizer is None:
            return None
        for i in set(ids) - self.cache.keys():
            self.cache[i] = self.tokenizer.decode([i], skip_special_tokens=False,
                                                  clean_up_tokenization_spaces=False)
        return [self.cache[i] for i in ids]


def trajectory_detail(traj: Trajectory, row: dict[str, Any], text: TokenText) -> dict[str, Any]:
    prompt, per_turn = split_messages(traj)
    trainer = traj.metrics.get("trainer_logprobs")
    if not isinstance(trainer, list) or len(trainer) != len(traj.segment):
        trainer = None
    segments = []
    for k, seg in enumerate(traj.segments):
        last = k == len(traj.segments) - 1
        policy = [i for i, s in enumerate(seg.sources) if s == Source.POLICY]
        segments.append({
            "ids": seg.token_ids, "text": text.texts(seg.token_ids), "sources": seg.sources, "turns": seg.turns,
            "mask": seg.loss_mask,
            # engine and trainer logprobs only where they mean something: on policy tokens
            "logprobs": {i: seg.logprobs[i] for i in policy},
            "trainer_logprobs": {i: trainer[i] for i in policy} if trainer is not None and last else {},
        })
    diffs = [abs(trainer[i] - traj.segment.logprobs[i]) for i in segments[-1]["trainer_logprobs"]] if trainer else []
    return {
        **row,
        "reward_parts": traj.reward_parts, "mask_reason": traj.mask_reason, "policy_version": traj.policy_version,
        "timings": traj.timings, "info": traj.info, "errors": [dataclasses.asdict(e) for e in traj.errors],
        "metrics": {k: v for k, v in traj.metrics.items() if k != "trainer_logprobs"},
        "prompt": prompt,
        "turns": [_turn(t, msgs) for t, msgs in zip(traj.turns, per_turn)],
        "segments": segments,
        "tokens_by_source": {s.name.lower(): traj.n_tokens(s) for s in Source},
        "mismatch_mean_abs": sum(diffs) / len(diffs) if diffs else None,
        "tokenizer": text.model if text.tokenizer is not None else f"none ({text.problem})",
    }


def _turn(turn: Any, messages: list[dict[str, Any]]) -> dict[str, Any]:
    replies = messages[1:]
    return {
        "index": turn.index, "segment": turn.segment, "finish_reason": turn.finish_reason, "text": turn.text,
        "tokens": turn.end - turn.start, "reward": turn.reward, "tool_reward": turn.tool_reward,
        "user_reward": turn.user_reward, "seconds": turn.seconds,
        "tool_calls": [dataclasses.asdict(c) for c in turn.tool_calls],
        "tool_results": [dataclasses.asdict(r) for r in turn.tool_results],
        "replies": replies,
        # the user's last word ends the conversation without being appended to the messages
        "final_user_reply": turn.user_reply if turn.user_reply and not any(
            m.get("role") == "user" for m in replies) else None,
    }
