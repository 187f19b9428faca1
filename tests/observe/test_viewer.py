"""The viewer's index, JSON API and export, on the shared run directory (see conftest.py)."""

import json
import re
import threading
import urllib.error
import urllib.request

import pytest

from turnrl.ledger import Source
from turnrl.observe.store import write_trajectories
from turnrl.observe.viewer.export import export_html
from turnrl.observe.viewer.index import RunIndex
from turnrl.observe.viewer.server import Viewer, is_loopback, make_server


@pytest.fixture(scope="module")
def viewer(run_dir):
    return Viewer(run_dir)


@pytest.fixture(scope="module")
def api(viewer):
    server = make_server(viewer, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def get(path):
        with urllib.request.urlopen(base + path, timeout=30) as r:
            return json.load(r) if path.startswith("/api/") else r.read().decode()
    yield get
    server.shutdown()
    server.server_close()


def test_steps_filters_and_rows_cover_the_run(api, ledger):
    steps = api("/api/steps")
    assert [(s["step"], s["split"], s["shown"], s["saved"]) for s in steps] == [
        (1, "train", 4, 4), (2, "eval", 2, 2), (2, "train", 4, 4), (3, "train", 3, 3)]
    filters = api("/api/filters")
    assert filters["terminations"] == sorted({t.termination for t, _ in ledger})
    assert len(filters["terminations"]) >= 3
    assert filters["tools"] == ["abacus", "calculator"]
    assert filters["errors"] == ["tool_parse"]
    assert filters["splits"] == ["eval", "train"]
    rows = api("/api/trajectories")
    assert [r["line"] for r in rows] == list(range(len(ledger)))
    assert [(r["reward"], r["termination"], r["group_id"]) for r in rows] == [
        (t.reward, t.termination, t.group_id) for t, _ in ledger]
    assert [r["id"] for r in api("/api/trajectories?step=2&split=eval")] == [
        i for i, (_, e) in enumerate(ledger) if e == {"step": 2, "split": "eval"}]


def test_detail_has_every_token_with_text_and_both_logprobs(api, ledger, smol_tokenizer):
    line = next(i for i, (t, _) in enumerate(ledger) if t.errors)     # the unknown tool
    traj, _ = ledger[line]
    d = api(f"/api/trajectory/{line}")
    seg, shown = traj.segment, d["segments"][-1]
    assert shown["ids"] == seg.token_ids and shown["sources"] == seg.sources and shown["mask"] == seg.loss_mask
    assert "".join(shown["text"]) == smol_tokenizer.decode(seg.token_ids)   # ASCII: per-token text adds up
    policy = [i for i, s in enumerate(seg.sources) if s == Source.POLICY]
    assert sorted(map(int, shown["logprobs"])) == policy
    trainer = traj.metrics["trainer_logprobs"]
    assert all(shown["trainer_logprobs"][str(i)] == trainer[i] for i in policy)
    assert d["mismatch_mean_abs"] == pytest.approx(0.0625)
    assert "trainer_logprobs" not in d["metrics"]
    assert d["errors"][0]["kind"] == "tool_parse"
    turn = d["turns"][0]
    assert turn["tool_calls"][0]["name"] == "abacus" and turn["tool_calls"][0]["arguments"] == {"beads": 3}
    assert turn["tool_results"][0]["error"] and turn["replies"][0]["role"] == "tool"
    assert d["prompt"][-1]["role"] == "user" and "What is" in d["prompt"][-1]["content"]
    assert d["tokens_by_source"]["tool"] == traj.n_tokens(Source.TOOL) > 0


def test_detail_shows_the_simulated_user(api, ledger):
    line = next(i for i, (t, _) in enumerate(ledger) if t.termination == "interaction_done")
    d = api(f"/api/trajectory/{line}")
    replies = [m for t in d["turns"] for m in t["replies"]]
    assert replies and all(m["role"] == "user" for m in replies)
    assert d["turns"][-1]["final_user_reply"]          # the last word is not in the messages
    assert d["tokens_by_source"]["user"] > 0


def test_group_is_the_prompts_samples_at_one_step(api, ledger):
    line = len(ledger) - 1
    g = api(f"/api/group/{line}")
    traj, extra = ledger[line]
    expected = [i for i, (t, e) in enumerate(ledger) if t.group_id == traj.group_id and e == extra]
    assert g["members"] == expected
    advantages = [ledger[i][0].metrics["advantage"] for i in expected]
    assert [d["advantage"] for d in g["details"]] == pytest.approx(advantages)


def test_unknown_things_are_404(api):
    for path in ("/api/trajectory/999", "/api/nothing", "/etc/passwd"):
        with pytest.raises(urllib.error.HTTPError) as err:
            api(path)
        assert err.value.code == 404


def test_page_is_served_with_the_colours_and_no_embedded_data(api):
    html = api("/")
    assert "/*SOURCE_CSS*/" not in html and '.tok[data-source="1"]' in html
    assert re.search(r'<script id="turnrl-data" type="application/json"></script>', html)


def test_index_keeps_at_most_per_step_and_reads_appended_lines(run_dir, ledger, tmp_path):
    path = tmp_path / "trajectories.jsonl"
    path.write_bytes((run_dir / "trajectories.jsonl").read_bytes())
    index = RunIndex(tmp_path, per_step=2)
    assert [(s["step"], s["split"], s["shown"], s["saved"]) for s in index.steps()] == [
        (1, "train", 2, 4), (2, "eval", 2, 2), (2, "train", 2, 4), (3, "train", 2, 3)]
    assert [r["line"] for r in index.rows(step=1)] == [0, 1]
    write_trajectories(path, [ledger[0][0]], append=True, step=4, split="train")
    with open(path, "a") as f:
        f.write('{"group_id": "half a line')           # still being written: not read yet
    index.refresh()
    assert index.steps()[-1]["step"] == 4 and index.rows(step=4)[0]["line"] == len(ledger)
    with open(path, "a") as f:
        f.write("\n")                                  # the half line, ended: skipped, said so
    write_trajectories(path, [ledger[1][0]], append=True, step=5, split="train")
    index.refresh()
    assert index.bad_lines == 1 and index.rows(step=5)[0]["line"] == len(ledger) + 2


def test_rollout_directories_have_no_steps(tmp_path, ledger):
    write_trajectories(tmp_path / "trajectories.jsonl", [t for t, _ in ledger[:3]])
    index = RunIndex(tmp_path)
    assert [(s["step"], s["split"], s["shown"]) for s in index.steps()] == [(0, "rollout", 3)]


def test_missing_run_dir_says_what_to_pass(tmp_path):
    with pytest.raises(ValueError, match="turnrl rollout"):
        RunIndex(tmp_path)


def test_only_loopback_is_quiet(viewer, capsys):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4")
    make_server(viewer, "0.0.0.0", 0, allow_remote=True).server_close()
    assert "WARNING" in capsys.readouterr().err


def test_export_is_one_self_contained_file(run_dir, ledger, tmp_path):
    out = export_html(run_dir, tmp_path / "share" / "run.html")
    assert [p.name for p in out.parent.iterdir()] == ["run.html"]
    html = out.read_text()
    assert not re.search(r"https?://|<link|@import|url\(|<script[^>]+src=|<img", html, re.I)
    data = json.loads(re.search(r'<script id="turnrl-data" type="application/json">(.*?)</script>', html, re.S)[1])
    assert len(data["rows"]) == len(data["details"]) == len(ledger)
    assert data["details"]["0"]["segments"][0]["ids"] == ledger[0][0].segment.token_ids
    assert data["groups"][str(len(ledger) - 1)] == [len(ledger) - 3, len(ledger) - 2, len(ledger) - 1]
