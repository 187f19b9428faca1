"""Secrets stay out of every output, references (env:/file:) are resolved only where used, the viewer stays
on loopback unless asked, and only what the user's config names is ever imported."""

import asyncio
import json
import os
import sys
import types
from pathlib import Path

import pytest
import yaml

from turnrl.cli import main
from turnrl.config import ConfigError, config_from_dict, load_config, to_dict
from turnrl.config.schema import RolloutConfig
from turnrl.config.secrets import redact, resolve_secret
from turnrl.data import Task
from turnrl.ledger import Trajectory
from turnrl.observe.metrics import MetricsLogger
from turnrl.observe.store import write_trajectories
from turnrl.observe.viewer.server import Viewer, make_server
from turnrl.rollout.factory import build_environment
from turnrl.train.trainer import Trainer

SECRET = "sk-live-0123456789abcdef"
CANARY_SOURCE = """
class Canary:
    name = "canary"
    schema = {"type": "function", "function": {"name": "canary", "parameters": {"type": "object", "properties": {}}}}

    def execute(self, args):
        return "imported"
"""


# -- references -------------------------------------------------------------------------------------------------
def test_a_key_from_the_environment_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_WANDB_KEY", SECRET)
    assert resolve_secret("env:MY_WANDB_KEY", "logging.wandb_api_key") == SECRET
    key_file = tmp_path / "wandb.key"
    key_file.write_text(f"  {SECRET}\n")
    assert resolve_secret(f"file:{key_file}", "logging.wandb_api_key") == SECRET
    assert resolve_secret(SECRET, "k") == SECRET and resolve_secret(None, "k") is None
    for ref, message in [("env:NOT_SET_ZQ", "environment variable NOT_SET_ZQ, which is not set"),
                         (f"file:{tmp_path / 'none'}", "cannot be read (No such file or directory)"),
                         (f"file:{tmp_path}", "cannot be read")]:
        with pytest.raises(ConfigError, match="'logging.wandb_api_key' refers to") as info:
            resolve_secret(ref, "logging.wandb_api_key")
        assert message in str(info.value)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="which is empty"):
        resolve_secret(f"file:{tmp_path / 'empty'}", "logging.wandb_api_key")
    with pytest.raises(ConfigError, match="write env:VARIABLE or file:/path"):
        config_from_dict({"logging": {"wandb_api_key": "file:"}})


def test_config_show_prints_references_and_hides_literal_keys(tmp_path, capsys):
    for value, shown in [(SECRET, "***"), ("env:WANDB_API_KEY", "env:WANDB_API_KEY"),
                         ("file:/run/secrets/wandb", "file:/run/secrets/wandb")]:
        assert main(["config", "show", str(_yaml(tmp_path, value))]) == 0
        out, err = capsys.readouterr()
        assert yaml.safe_load(out)["logging"]["wandb_api_key"] == shown and SECRET not in out + err


def _yaml(tmp_path, value):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"logging": {"wandb_api_key": value}}))
    return path


def test_the_tracker_gets_the_key_from_its_file_and_a_redacted_config(tmp_path, monkeypatch):
    seen = {}
    fake = types.SimpleNamespace(init=lambda **kw: seen.update(kw) or types.SimpleNamespace(finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text(SECRET)
    cfg = config_from_dict({}, [f"logging.wandb_api_key=file:{key_file}"])
    MetricsLogger(tmp_path, ["wandb"], config=to_dict(cfg), api_key=cfg.logging.wandb_api_key).close()
    assert os.environ["WANDB_API_KEY"] == SECRET                      # what wandb reads
    assert SECRET not in json.dumps(seen["config"])


# -- nothing written holds the key ------------------------------------------------------------------------------
def test_no_run_file_and_no_log_line_holds_the_key(tmp_path, capfd):
    cfg = load_config(None, ["model.name=tiny-random", "engine.dtype=float32", "trainer.dtype=float32",
                             "logging.sinks=[console]", f"logging.wandb_api_key={SECRET}", f"output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    try:
        trainer.logger.log(1, {"reward/mean": 0.5})
        trainer.save(1)                                  # a checkpoint, with its trainer_state.json
    finally:
        trainer.logger.close()
        asyncio.run(trainer.engine.close())
    state = json.loads((tmp_path / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert state["config"]["logging"]["wandb_api_key"] == "***"
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["logging"]["wandb_api_key"] == "***"
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".json", ".jsonl", ".txt", ""):
            assert SECRET not in path.read_text(errors="replace"), path
    out, err = capfd.readouterr()
    assert SECRET not in out + err


def test_traces_and_the_viewer_never_show_a_key(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVICE_API_KEY", SECRET)
    traj = Trajectory("g", 0, [{"role": "user", "content": "hi"}, {"role": "tool", "content": f"env: {SECRET}"}])
    traj.add_error("tool_error", f"HTTP 401 for https://api.example/v1?key={SECRET}")
    write_trajectories(tmp_path / "trajectories.jsonl", [traj], step=1, split="train")
    text = (tmp_path / "trajectories.jsonl").read_text()
    assert SECRET not in text and text.count("***") == 3          # the tool output, the error, the mask reason
    viewer = Viewer(tmp_path)
    assert SECRET not in json.dumps(viewer.detail(viewer.index.rows(None, None)[0]["id"]))
    assert redact(f"a {SECRET} b") == "a *** b" and redact("short ok") == "short ok"


# -- the viewer -------------------------------------------------------------------------------------------------
def test_the_viewer_refuses_other_addresses_unless_asked(tmp_path, capsys):
    write_trajectories(tmp_path / "trajectories.jsonl", [Trajectory("g", 0, [])], step=1, split="train")
    viewer = Viewer(tmp_path)
    for host in ("0.0.0.0", "::", "192.168.1.4"):
        with pytest.raises(ValueError, match=f"refusing to serve on {host}.*--allow-remote"):
            make_server(viewer, host, 0)
    make_server(viewer, "127.0.0.1", 0).server_close()
    assert main(["view", str(tmp_path), "--host", "0.0.0.0"]) == 2
    assert "refusing to serve on 0.0.0.0" in capsys.readouterr().err
    make_server(viewer, "0.0.0.0", 0, allow_remote=True).server_close()
    assert "WARNING" in capsys.readouterr().err


# -- imports ------------------------------------------------------------------------------------------------------
@pytest.fixture()
def canary(tmp_path):
    """A module file nothing has imported yet (fresh per test)."""
    path = tmp_path / f"canary_{tmp_path.name}.py"
    path.write_text(CANARY_SOURCE)
    return path


def imported(path: Path) -> bool:
    return any(getattr(m, "__file__", None) == str(path) for m in list(sys.modules.values()))


def test_rows_cannot_make_turnrl_import_anything(fault_loop, canary, monkeypatch):
    monkeypatch.syspath_prepend(str(canary.parent))            # even importable by module name
    env = build_environment(RolloutConfig())
    names = [f"{canary}:Canary", f"{canary.stem}:Canary", "os:system", "subprocess.run"]
    tasks = [Task(uid=f"t{i}", messages=[{"role": "user", "content": f"[case:c{i}] hi"}], tools=[name])
             for i, name in enumerate(names)]
    tasks += [Task(uid=f"i{i}", messages=[{"role": "user", "content": f"[case:d{i}] hi"}], tools=[],
                   interaction={"name": name}) for i, name in enumerate(names)]
    loop = fault_loop({f"{p}{i}": ["ok"] for p in "cd" for i in range(len(names))}, env)

    async def run_all():
        return await asyncio.gather(*(loop.run(t) for t in tasks))
    for traj in asyncio.run(run_all()):
        assert traj.masked and traj.errors[0].kind == "internal"
        assert "unknown tool" in traj.errors[0].message or "unknown interaction" in traj.errors[0].message
    assert not imported(canary) and canary.stem not in sys.modules


def test_a_tool_config_imports_only_the_class_it_names(tmp_path, canary):
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [{"class_name": "calculator", "config": {"note": f"{canary}:Canary"}}]}))
    with pytest.raises(ConfigError, match="cannot be built with config"):   # config values are data, not imports
        build_environment(RolloutConfig(tool_config_path=str(path)))
    assert not imported(canary)
    with pytest.raises(ConfigError, match="unknown tool 'canary'"):
        build_environment(config_from_dict({}, ["rollout.tools=[{class_name: canary}]"]).rollout)
    env = build_environment(config_from_dict({}, [f"rollout.tools=[{{class_name: '{canary}:Canary'}}]"]).rollout)
    assert imported(canary) and env.default_tools == ["canary"]          # named by the user's config: loaded
