"""Secrets are redacted by value, not only by a few variable-name endings (issue 17 item 7), and the viewer
answers only requests addressed to a loopback name (item 8: DNS rebinding)."""

import threading
import urllib.error
import urllib.request

import pytest

from turnrl.config import dump_yaml
from turnrl.config.secrets import redact
from turnrl.ledger import Trajectory
from turnrl.observe.metrics import JsonlSink
from turnrl.observe.store import write_trajectories
from turnrl.observe.viewer.server import Viewer, make_server

ENV = {"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY", "AZURE_OPENAI_KEY": "az0penai9f8e7d6c5b4a",
       "GH_PAT": "ghp_16C7e42F292c6912E7710c838347Ae178B4a", "MY_JUDGE_KEY": "judge-key-5f4dcc3b5aa7",
       "DATABASE_URL": "postgres://admin:hunter2-db-pass@db.internal:5432/app"}
VALUES = [v for k, v in ENV.items() if k != "DATABASE_URL"] + ["hunter2-db-pass"]


@pytest.fixture()
def secret_env(monkeypatch):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)


def echo_of_the_environment():
    return "\n".join(f"{k}={v}" for k, v in ENV.items())


def test_a_tool_echoing_its_environment_leaks_nothing_into_traces(tmp_path, secret_env):
    traj = Trajectory("g", 0, [{"role": "user", "content": "env?"}, {"role": "tool", "content": echo_of_the_environment()}])
    traj.add_error("tool_error", "connect to https://bob:s3cr3t-inline-pw@api.example/v1 failed")
    write_trajectories(tmp_path / "trajectories.jsonl", [traj], step=1, split="train")
    text = (tmp_path / "trajectories.jsonl").read_text()
    for value in VALUES + ["s3cr3t-inline-pw"]:
        assert value not in text, value
    assert "postgres://admin:***@db.internal" in text and "AWS_SECRET_ACCESS_KEY=***" in text


def test_metrics_and_tables_leak_nothing(tmp_path, secret_env):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.log(1, {"reward/mean": 0.5})
    sink.log_table(1, "generations", [{"output": echo_of_the_environment()}])
    text = (tmp_path / "tables.jsonl").read_text()
    assert not any(v in text for v in VALUES)


def test_config_show_hides_keys_in_urls_and_extra_body(tmp_path):
    from turnrl.config.schema import LLMConfig
    judge = LLMConfig(model="judge", base_url="https://user:url-key-1234567@judge.example/v1",
                      extra_body={"api_key": "body-key-7654321", "top_p": 0.9})
    text = dump_yaml(judge)          # what `turnrl config show`, a run's config.yaml and trackers get
    assert "url-key-1234567" not in text and "body-key-7654321" not in text
    assert "https://user:***@judge.example/v1" in text and "top_p: 0.9" in text


def serve(tmp_path, raw_text):
    (tmp_path / "trajectories.jsonl").write_text(raw_text)        # written by an older turnrl, unredacted
    server = make_server(Viewer(tmp_path), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def get(port, path, host=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_viewer_redacts_and_answers_only_loopback_host_names(tmp_path, secret_env):
    traj = Trajectory("g", 0, [{"role": "tool", "content": echo_of_the_environment()}])
    traj.termination = "eos"
    write_trajectories(tmp_path / "clean.jsonl", [traj], step=1, split="train")
    raw = (tmp_path / "clean.jsonl").read_text()
    for k, v in ENV.items():   # put the clear values back, as an old file would hold them
        raw = raw.replace(f"{k}=***", f"{k}={v}")
    server = serve(tmp_path, raw)
    port = server.server_address[1]
    try:
        status, body = get(port, "/api/trajectory/0")
        assert status == 200 and not any(v in body for v in VALUES)
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
            assert get(port, "/api/steps", host)[0] == 200, host
        for host in (f"evil.example:{port}", "attacker.test", f"127.0.0.1.nip.io:{port}"):
            status, body = get(port, "/api/steps", host)
            assert status == 403 and "Host" in body, host
    finally:
        server.shutdown()
        server.server_close()


def test_redact_by_value(secret_env):
    text = redact(echo_of_the_environment())
    assert not any(v in text for v in VALUES)
    assert redact("PATH=/usr/bin KEYBOARD=us") == "PATH=/usr/bin KEYBOARD=us"
