"""`turnrl view` and `turnrl plot`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from turnrl.cli import command


def _view_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="a run directory with trajectories.jsonl (rollout, train or eval)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a --host that other machines can reach (no authentication: anyone who can reach "
                        "the port reads the trajectories)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: a free one, printed)")
    p.add_argument("--per-step", type=int, default=32, help="at most this many trajectories per step and split")
    p.add_argument("--export", type=Path, default=None, metavar="OUT.html",
                   help="write one self-contained HTML file instead of serving")


@command("view", "browse a run's trajectories in a web page (or export one HTML file)", _view_args)
def cmd_view(a: argparse.Namespace) -> int:
    try:
        if a.export is not None:
            from turnrl.observe.viewer.export import export_html
            out = export_html(a.run_dir, a.export, a.per_step)
            print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
        else:
            from turnrl.observe.viewer.server import serve
            serve(a.run_dir, a.host, a.port, a.per_step, a.allow_remote)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="run directory with metrics.jsonl; plots go to RUN_DIR/plots")
    p.add_argument("compare", type=Path, nargs="*", help="other run directories to overlay (-> RUN_DIR/plots/compare)")
    p.add_argument("--out", type=Path, default=None, help="write the PNGs here instead")


@command("plot", "draw a run's metrics as PNGs (several runs overlaid)", _plot_args)
def cmd_plot(a: argparse.Namespace) -> int:
    from turnrl.observe.plots import write_plots
    try:
        written = write_plots(a.run_dir, a.compare, a.out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not written:
        print(f"no metrics to plot in {a.run_dir}/metrics.jsonl")
        return 1
    for path in written:
        print(path)
    return 0
