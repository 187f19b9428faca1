"""Core modules import without the optional extras: the GPU machine, for one, has no HTTP stack. A module
that needs an extra imports it where it is used and says which extra to install."""

import subprocess
import sys

BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ImportError(f'No module named {{name!r}}', name=name)
sys.meta_path.insert(0, Block())
"""


def imports_without(modules, blocked):
    code = BLOCK.format(blocked=set(blocked)) + "".join(f"import {m}\n" for m in modules)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_the_trainer_engines_and_benchmarks_import_without_the_gateway_extras():
    done = imports_without(["turnrl.train.trainer", "turnrl.engines.fast", "turnrl.bench.train",
                            "turnrl.bench.rollout", "turnrl.cli"], ["fastapi", "uvicorn", "mcp", "verifiers"])
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_agent_run_without_the_extra_says_which_to_install(tmp_path):
    code = BLOCK.format(blocked={"fastapi"}) + f"""
from turnrl.config import load_config
from turnrl.train.trainer import Trainer
cfg = load_config(None, ["model.name=tiny-random", "agent.entrypoint=os:getcwd", "output_dir={tmp_path}",
                         "logging.sinks=[]", "logging.progress=off"])
try:
    Trainer(cfg)
except ImportError as exc:
    print("ERR", exc)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "ERR" in done.stdout and "pip install 'turnrl[agents]'" in done.stdout, done.stdout + done.stderr[-2000:]
