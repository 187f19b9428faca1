"""PNG plots of a run's metrics.jsonl, redrawn after every training step and by `turnrl plot`.

One figure per group of metrics (reward and accuracy, length and turns, KL/entropy/mismatch, tool use,
throughput and phase timings, losses); each figure has one panel per unit, each panel one line per metric
(and per run when runs are compared: colour = metric, line style = run). Metrics a run did not log are
left out, and so are panels and figures left empty. Eval metrics exist only at eval steps: their lines
join the steps they were measured at. A step logged twice (a resumed run) keeps its last value.
Figures are drawn with matplotlib's object API on the Agg canvas (no pyplot state, no display needed) and
written atomically, so a viewer never sees half a PNG. Drawing takes a fraction of a second, so the training
loops' `refresh_plots` redraws at most every `min_interval_s` and draws what it skipped at exit.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from turnrl.observe.metrics import read_metrics


class Panel(NamedTuple):
    ylabel: str
    keys: tuple[str, ...]


class FigureSpec(NamedTuple):
    name: str            # file name without .png
    title: str
    panels: tuple[Panel, ...]


FIGURES = (
    FigureSpec("reward", "Reward and accuracy", (
        Panel("reward", ("reward/mean", "eval/reward_mean")),
        Panel("accuracy", ("accuracy", "eval/accuracy")))),
    FigureSpec("length", "Response length and turns", (
        Panel("policy tokens per trajectory", ("response_tokens/mean",)),
        Panel("turns per trajectory", ("turns/mean", "eval/turns_mean")))),
    FigureSpec("kl", "KL, entropy and trainer-engine mismatch", (
        Panel("KL (nats/token)", ("kl/ref", "approx_kl/old", "mismatch/kl")),
        Panel("entropy (nats/token)", ("entropy",)),
        Panel("|trainer - engine| logprob", ("mismatch/mean_abs", "mismatch/max_abs")))),
    FigureSpec("tools", "Tool calls and errors", (
        Panel("count per step", ("tool/calls", "tool/errors", "masked")),)),
    FigureSpec("throughput", "Throughput and phase timings", (
        Panel("tokens/s", ("throughput/tokens_per_s", "throughput/train_tokens_per_s")),
        Panel("seconds per step", ("time/rollout_s", "time/reward_s", "time/logprob_s", "time/update_s",
                                   "time/sync_s", "time/step_s")))),
    FigureSpec("loss", "Losses", (
        Panel("loss", ("loss/policy", "sft/loss")),
        Panel("gradient norm", ("grad_norm",)))),
)
LINE_STYLES = ("-", "--", ":", "-.")


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric; non-numbers and non-finite values are skipped."""
    by_step: dict[int, float] = {}
    for r in records:
        value, step = r.get(key), r.get("step")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and isinstance(step, int):
            by_step[step] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def build_figures(runs: list[tuple[str, list[dict[str, Any]]]]) -> list[tuple[str, Any]]:
    """(name, matplotlib Figure) for every group that has data in at least one run."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figures = []
    for spec in FIGURES:
        panels = [(p, [(k, name, series(records, k)) for k in p.keys for name, records in runs]) for p in spec.panels]
        panels = [(p, [line for line in lines if line[2][0]]) for p, lines in panels]
        panels = [(p, lines) for p, lines in panels if lines]
        if not panels:
            continue
        fig = Figure(figsize=(5.2 * len(panels), 3.8), layout="constrained")
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for ax, (panel, lines) in zip(axes, panels):
            for key, name, (xs, ys) in lines:
                colour = f"C{panel.keys.index(key)}"
                style = LINE_STYLES[[n for n, _ in runs].index(name) % len(LINE_STYLES)]
                ax.plot(xs, ys, color=colour, linestyle=style, marker="o" if len(xs) <= 30 else None, markersize=3,
                        label=key if len(runs) == 1 else f"{key} ({name})")
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(panel.ylabel)
            ax.ticklabel_format(axis="y", useOffset=False)
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
        names = ", ".join(name for name, _ in runs)
        fig.suptitle(f"{spec.title} - {names}", fontsize="medium")
        figures.append((spec.name, fig))
    return figures


def run_names(paths: list[Path]) -> list[str]:
    """Directory names, or full paths where two runs share a name."""
    names = [p.resolve().name for p in paths]
    return [n if names.count(n) == 1 else str(p) for n, p in zip(names, paths)]


def write_plots(run_dir: Path, compare: list[Path] | None = None, out: Path | None = None) -> list[Path]:
    """Draw RUN_DIR's metrics (overlaid with `compare` runs) into `out` (RUN_DIR/plots, or
    RUN_DIR/plots/compare when comparing); returns the PNGs written."""
    paths = [Path(run_dir), *(Path(p) for p in compare or [])]
    for p in paths:
        if not p.is_dir():
            raise ValueError(f"{p} is not a run directory")
    runs = [(name, read_metrics(p / "metrics.jsonl")) for name, p in zip(run_names(paths), paths)]
    out = Path(out) if out is not None else Path(run_dir) / "plots" / ("compare" if compare else "")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in build_figures(runs):
        target = out / f"{name}.png"
        tmp = target.with_name(f".{name}.{os.getpid()}.png")
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, target)
        written.append(target)
    return written


_last_drawn: dict[Path, float] = {}
_skipped: set[Path] = set()


def refresh_plots(run_dir: Path, min_interval_s: float = 15.0) -> None:
    """`write_plots` for the training loops: at most every `min_interval_s` (a skipped refresh is drawn at
    exit); a plotting failure is reported, never raised."""
    key = Path(run_dir)
    now = time.monotonic()
    if key in _last_drawn and now - _last_drawn[key] < min_interval_s:
        _skipped.add(key)
        return
    _skipped.discard(key)
    _last_drawn[key] = now
    try:
        write_plots(key)
    except Exception as exc:  # noqa: BLE001 - plots are a view; they must not stop a training run
        print(f"[turnrl] warning: plots in {key}/plots not refreshed: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)


@atexit.register
def _draw_skipped() -> None:
    for key in list(_skipped):
        refresh_plots(key, min_interval_s=0.0)
