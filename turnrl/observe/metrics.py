"""One logging interface, several sinks: JSONL (always), console table, TensorBoard, wandb, MLflow.

Optional sinks are imported only when configured; a missing package is an error that says what to install.
Besides scalars, sinks take tables (`log_table`: validation generations, one dict per row) where their
tracker has them: wandb Tables, MLflow's `log_table`, TensorBoard text; JSONL appends them to tables.jsonl
next to metrics.jsonl; the console leaves them out.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from turnrl.config.secrets import redact, resolve_secret
from turnrl.observe.conversation import final_answer, prompt_text
from turnrl.observe.progress import format_table

if TYPE_CHECKING:
    from turnrl.ledger import Trajectory

CONSOLE_KEYS = ("sft/loss", "reward/mean", "accuracy", "turns/mean", "tool/calls", "tool/errors", "masked",
                "response_tokens/mean", "loss/policy", "kl/ref", "entropy", "clip_fraction", "grad_norm", "lr",
                "mismatch/mean_abs", "time/step_s", "time/rollout_s", "time/update_s", "throughput/tokens_per_s")


class Sink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None: ...
    def close(self) -> None: ...


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    """Every key of every row, in first-seen order."""
    return list(dict.fromkeys(k for row in rows for k in row))


class JsonlSink:
    """metrics.jsonl and tables.jsonl, appended to. The first step a sink logs replaces what the files hold
    from that step on: a run resumed from its last checkpoint logs again the steps the killed run had logged
    after it (and a line a kill cut short is dropped), so each step appears once."""

    def __init__(self, path: Path, table_path: Path | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.table_path = table_path or path.with_name("tables.jsonl")
        self.file = self.tables = None

    def _open(self, step: int) -> None:
        if self.file is None:
            for path in (self.path, self.table_path):
                drop_steps_from(path, step)
            self.file = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._open(step)
        clean = {k: _finite(v) for k, v in metrics.items()}
        self.file.write(redact(json.dumps({"step": step, **clean})) + "\n")
        self.file.flush()

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        self._open(step)
        if self.tables is None:
            self.tables = open(self.table_path, "a", encoding="utf-8")
        clean = [{k: _finite(v) for k, v in row.items()} for row in rows]
        self.tables.write(redact(json.dumps({"step": step, "name": name, "rows": clean}, ensure_ascii=False)) + "\n")
        self.tables.flush()

    def close(self) -> None:
        for f in (self.file, self.tables):
            if f is not None:
                f.close()


def drop_steps_from(path: Path, step: int) -> None:
    """Rewrite a JSONL log without its lines for `step` and later, and without lines that do not parse."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    keep = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int) or record["step"] < step:
            keep.append(line if line.endswith("\n") else line + "\n")
    if len(keep) != len(lines):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(keep), encoding="utf-8")
        os.replace(tmp, path)


class ConsoleSink:
    def log(self, step: int, metrics: dict[str, float]) -> None:
        shown = {k: metrics[k] for k in CONSOLE_KEYS if k in metrics}
        shown.update({k: v for k, v in metrics.items() if k.startswith("eval/") and k.endswith(("mean", "accuracy"))})
        print(format_table(shown, f"step {step}"), file=sys.stdout, flush=True)

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        pass   # generations would drown the metrics table; they are in tables.jsonl

    def close(self) -> None:
        pass


def _markdown_cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", "<br>")


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError("logging.sinks has 'tensorboard' but it is not installed: "
                             "pip install 'turnrl[tensorboard]'") from None
        self.writer = SummaryWriter(str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        columns = _columns(rows)
        lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        lines += ["| " + " | ".join(_markdown_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
        self.writer.add_text(name, "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, run_name: str | None, config: dict[str, Any], api_key: str | None):
        try:
            import wandb
        except ImportError:
            raise ValueError("logging.sinks has 'wandb' but it is not installed: pip install 'turnrl[wandb]'") from None
        api_key = resolve_secret(api_key, "logging.wandb_api_key")
        if api_key:
            os.environ.setdefault("WANDB_API_KEY", api_key)
        self.run = wandb.init(project=project, name=run_name, config=config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        import wandb
        columns = _columns(rows)
        self.run.log({name: wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])},
                     step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """One MLflow run. The tracking server is MLflow's own setting (MLFLOW_TRACKING_URI); without it the
    run is stored in RUN_DIR/mlflow.db rather than in whatever directory training was started from."""

    def __init__(self, out_dir: Path, experiment: str, run_name: str | None, config: dict[str, Any]):
        try:
            import mlflow
        except ImportError:
            raise ValueError("logging.sinks has 'mlflow' but it is not installed: "
                             "pip install 'turnrl[mlflow]'") from None
        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri(f"sqlite:///{(out_dir / 'mlflow.db').resolve()}")
        mlflow.set_experiment(experiment)
        self.run = mlflow.start_run(run_name=run_name)
        params = _flatten(config)
        for i in range(0, len(params), 100):   # MLflow takes at most 100 params per call
            mlflow.log_params(dict(list(params.items())[i:i + 100]))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        numbers = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        self.mlflow.log_metrics(numbers, step=step)

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        columns = _columns(rows)
        self.mlflow.log_table({c: [row.get(c) for row in rows] for c in columns},
                              artifact_file=f"{name}/step_{step:06d}.json")

    def close(self) -> None:
        self.mlflow.end_run()


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:500]   # MLflow's limit on a param value
    return out


class MetricsLogger:
    def __init__(self, out_dir: Path, sinks: list[str], project: str = "turnrl", run_name: str | None = None,
                 config: dict[str, Any] | None = None, api_key: str | None = None):
        self.sinks: list[Sink] = [JsonlSink(out_dir / "metrics.jsonl")]
        for name in sinks:
            if name == "console":
                self.sinks.append(ConsoleSink())
            elif name == "tensorboard":
                self.sinks.append(TensorBoardSink(out_dir / "tensorboard"))
            elif name == "wandb":
                self.sinks.append(WandbSink(project, run_name, config or {}, api_key))
            elif name == "mlflow":
                self.sinks.append(MlflowSink(out_dir, project, run_name, config or {}))
            else:
                raise ValueError(f"unknown metrics sink '{name}'; known: console, tensorboard, wandb, mlflow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        """One table (a list of rows with the same keys), e.g. validation generations."""
        for sink in self.sinks:
            sink.log_table(step, name, rows)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def generation_rows(trajectories: list[Trajectory]) -> list[dict[str, Any]]:
    """Validation generations as table rows: the question, the policy's last answer, the reward."""
    return [{"prompt": prompt_text(t), "answer": final_answer(t), "ground_truth": str(t.info.get("ground_truth", "")),
             "reward": t.reward, "termination": t.termination} for t in trajectories]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
