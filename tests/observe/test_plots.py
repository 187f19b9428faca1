"""Plots: one PNG per metric group, labelled axes, one legend line per metric (and per run when comparing)."""

import json

import pytest

from turnrl.cli import main
from turnrl.observe.metrics import read_metrics
from turnrl.observe.plots import FIGURES, build_figures, refresh_plots, series, write_plots

PNG = b"\x89PNG\r\n\x1a\n"


def metrics_dir(path, records):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def axes_of(figures):
    """{figure name: [(xlabel, ylabel, [legend labels])]}"""
    return {name: [(ax.get_xlabel(), ax.get_ylabel(), [t.get_text() for t in ax.get_legend().get_texts()])
                   for ax in fig.axes] for name, fig in figures}


def test_every_group_is_written_with_labelled_axes(run_dir, tmp_path):
    written = write_plots(run_dir, out=tmp_path)
    assert sorted(p.name for p in written) == sorted(f"{f.name}.png" for f in FIGURES)
    assert all(p.read_bytes().startswith(PNG) and p.stat().st_size > 5000 for p in written)
    assert not list(tmp_path.glob(".*"))     # no temporary files left
    axes = axes_of(build_figures([("run", read_metrics(run_dir / "metrics.jsonl"))]))
    assert axes["reward"] == [("step", "reward", ["reward/mean", "eval/reward_mean"]),
                              ("step", "accuracy", ["accuracy", "eval/accuracy"])]
    assert axes["throughput"][1] == ("step", "seconds per step", ["time/rollout_s", "time/reward_s", "time/logprob_s",
                                                                   "time/update_s", "time/sync_s"])
    for panels in axes.values():
        for xlabel, ylabel, labels in panels:
            assert xlabel == "step" and ylabel and labels and len(labels) == len(set(labels))


def test_lines_follow_the_logged_steps():
    records = [{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": None}, {"step": 3, "reward/mean": 0.3},
               {"step": 3, "reward/mean": 0.4, "eval/reward_mean": 0.5}, {"step": 4, "reward/mean": float("nan")}]
    assert series(records, "reward/mean") == ([1, 3], [0.1, 0.4])    # a re-logged step keeps its last value
    (name, fig), = build_figures([("r", records)])
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].get_lines()}
    assert lines == {"reward/mean": ([1, 3], [0.1, 0.4]), "eval/reward_mean": ([3], [0.5])}


def test_missing_metrics_skip_panels_and_figures(tmp_path):
    run = metrics_dir(tmp_path / "sft", [{"step": s, "sft/loss": 2.0 / s, "grad_norm": 1.0} for s in (1, 2, 3)])
    assert [p.name for p in write_plots(run)] == ["loss.png"]
    assert (run / "plots" / "loss.png").is_file()
    assert write_plots(metrics_dir(tmp_path / "empty", [])) == []


def test_compare_overlays_runs(tmp_path):
    a = metrics_dir(tmp_path / "a", [{"step": s, "reward/mean": 0.1 * s} for s in (1, 2)])
    b = metrics_dir(tmp_path / "b", [{"step": s, "reward/mean": 0.2 * s, "accuracy": 0.5} for s in (1, 2, 3)])
    written = write_plots(a, [b])
    assert written == [a / "plots" / "compare" / "reward.png"]
    axes = axes_of(build_figures([("a", [{"step": 1, "reward/mean": 0.1}]), ("b", [{"step": 1, "reward/mean": 0.2}])]))
    assert axes["reward"] == [("step", "reward", ["reward/mean (a)", "reward/mean (b)"])]


def test_plot_command(tmp_path, capsys):
    run = metrics_dir(tmp_path / "run", [{"step": 1, "reward/mean": 0.5, "tool/calls": 3}])
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.split() == [str(run / "plots" / "reward.png"), str(run / "plots" / "tools.png")]
    assert main(["plot", str(tmp_path / "nowhere")]) == 2


def test_refresh_only_warns(tmp_path, capsys, monkeypatch):
    import turnrl.observe.plots as plots

    def broken(*args, **kwargs):
        raise RuntimeError("no fonts")
    monkeypatch.setattr(plots, "write_plots", broken)
    refresh_plots(tmp_path)
    err = capsys.readouterr().err
    assert "not refreshed" in err and "no fonts" in err


@pytest.mark.parametrize("bad", [[], [{"step": "x", "reward/mean": 1.0}], [{"reward/mean": 1.0}]])
def test_nothing_plottable_writes_nothing(tmp_path, bad):
    assert write_plots(metrics_dir(tmp_path / "r", bad)) == []


def test_refresh_is_throttled_and_catches_up_at_exit(tmp_path, monkeypatch):
    import turnrl.observe.plots as plots
    drawn = []
    monkeypatch.setattr(plots, "write_plots", lambda run_dir: drawn.append(run_dir))
    monkeypatch.setattr(plots, "_skipped", set())      # runs trained earlier in this process left theirs
    run = tmp_path / "run"
    refresh_plots(run, min_interval_s=60)
    refresh_plots(run, min_interval_s=60)      # too soon: skipped, remembered
    assert drawn == [run]
    plots._draw_skipped()                      # what runs at exit
    assert drawn == [run, run]
    plots._draw_skipped()
    assert drawn == [run, run]
