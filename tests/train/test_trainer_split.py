"""A training run with a chat template that is not append-only: Qwen3's (tests/chat/templates/qwen3.jinja) in its
non-thinking mode (`model.chat_template_kwargs: {enable_thinking: false}`) prompts each turn with an empty thinking
block, which it keeps on the latest assistant turn only: each user reply rewrites the past turns. With
`rollout.on_mismatch: split` each break starts a new training sample from a full re-render; the trainer trains
on every segment, and `turnrl view` shows the segments of each trajectory. (In thinking mode, a policy that does
not think, as this random one, also differs at the end: the template writes an empty thinking block into the
finished last turn, and the trajectory's parity says `mismatch`.)"""

import asyncio
import json
from pathlib import Path

from turnrl.config import load_config
from turnrl.ledger import Source
from turnrl.observe.viewer.index import load_line
from turnrl.observe.viewer.server import Viewer
from turnrl.train.trainer import Trainer

QWEN3 = Path(__file__).parents[1] / "chat" / "templates" / "qwen3.jinja"


def test_qwen3_template_trains_on_split_samples_and_the_viewer_shows_them(tmp_path):
    cfg = load_config(None, [
        "model.name=tiny-random", "engine.dtype=float32", "trainer.dtype=float32", f"model.chat_template={QWEN3}",
        "model.chat_template_kwargs.enable_thinking=false",
        "rollout.on_mismatch=split", "rollout.tool_parser=auto",
        "data.train.task=guess_number", "data.train.size=4", "data.prompts_per_step=2", "rollout.n=2",
        "rollout.max_assistant_turns=3", "rollout.max_response_tokens=200", "rollout.sampling.max_tokens_per_turn=8",
        "trainer.steps=2", "trainer.optim.lr=1e-3", "logging.sinks=[]", "logging.progress=off",
        f"output_dir={tmp_path}"])
    history = asyncio.run(Trainer(cfg).run())
    assert len(history) == 2 and all("loss/policy" in h for h in history)
    assert sum(h.get("parity/split", 0) for h in history) > 0

    lines = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    trajs = [load_line(x)[0] for x in lines]
    split = [t for t in trajs if t.parity == "split"]
    assert split and not [e for t in trajs for e in t.errors if e.kind == "chat"]
    for t in split:
        assert len(t.segments) >= 2 and t.metrics["chat_mismatches"] == len(t.segments) - 1
        assert {turn.segment for turn in t.turns} == set(range(len(t.segments)))
        for seg in t.segments[1:]:  # a fresh sample: the re-rendered conversation, then the policy's next turn
            assert seg.sources[0] == Source.PROMPT and Source.POLICY in seg.sources
        t.check()

    viewer = Viewer(tmp_path)
    row = next(r for r in viewer.index.rows() if r["parity"] == "split")
    detail = viewer.detail(row["id"])
    assert detail["parity"] == "split" and len(detail["segments"]) >= 2
    assert all(len(s["ids"]) == len(s["text"]) == len(s["sources"]) > 0 for s in detail["segments"])
    assert {t["segment"] for t in detail["turns"]} == set(range(len(detail["segments"])))
    # the page labels each segment (the same code renders an export)
    assert "segment ${k}" in (Path(__file__).parents[2] / "turnrl/observe/viewer/page.html").read_text()
