"""The plots' content, checked on matplotlib's figure objects (labels, legends, ticks), not pixels."""

from __future__ import annotations

import json

import pytest

from hpc_rlx.observe import plots as report_plots
from hpc_rlx.observe.run_files import load_run

from tests.support.jobs import explain, train_job
from tests.mpi.report.test_report import make_run, make_sweep

pytest.importorskip("matplotlib")


def _labels(ax) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend is not None else []


def _check_every_panel_is_labelled(fig) -> None:
    main_axes = [ax for ax in fig.axes if ax.get_legend() is not None or ax.get_xlabel()]
    assert main_axes
    for ax in fig.axes:
        if not ax.get_xlabel() and not ax.get_legend():      # a twin axis: its y label is enough
            assert ax.get_ylabel(), f"axis {ax.get_title()!r} has no labels"
            continue
        assert ax.get_xlabel(), f"panel {ax.get_title()!r} has no x label"
        assert ax.get_ylabel(), f"panel {ax.get_title()!r} has no y label"
        assert _labels(ax), f"panel {ax.get_title()!r} has no legend"


def _integer_ticks(ax) -> list[float]:
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo - 1e-9 <= t <= hi + 1e-9]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    return ticks


@pytest.mark.mpi
def test_a_short_run_draws_its_training_curves_from_the_step_log(tmp_path, digits_h5):
    run_dir = tmp_path / "run"
    proc = train_job(2, run_dir, [f"data.path={digits_h5}", "train.epochs=2", "data=file"])
    assert proc.returncode == 0, explain(proc)
    files = load_run(run_dir)
    assert len(files.steps) >= 3 and report_plots.uses_steps(files)
    fig = report_plots.curves_figure(files)
    loss_ax = next(ax for ax in fig.axes if ax.get_title() == "loss")
    lines = {ln.get_label(): ln for ln in loss_ax.get_lines()}
    per_step = lines["train loss (per step)"]
    assert len(per_step.get_xdata()) == len(files.steps) >= 3          # not two points
    assert list(lines["val loss (per epoch)"].get_xdata()) == [1.0, 2.0]
    assert max(per_step.get_xdata()) <= 2.0
    for ax in fig.axes:
        if ax.get_xlabel():
            assert ax.get_xlabel() == "epoch"
            assert set(_integer_ticks(ax)) >= {1.0, 2.0}
    _check_every_panel_is_labelled(fig)
    throughput = next(ax for ax in fig.axes if ax.get_title().startswith("throughput"))
    assert {"samples/s (all ranks, step wall time)", "learning rate"} <= set(_labels(throughput))


def test_per_step_curves_that_stop_short_of_the_last_epoch_still_show_its_tick(tmp_path):
    """steps.jsonl is sampled at a bounded rate, so its last record can sit at epoch 1.9 of a
    2-epoch run; every epoch axis must still reach and label epoch 2."""
    run = make_run(tmp_path / "run", epochs=2)
    with open(run / "steps.jsonl", "w") as f:
        for i in range(1, 20):
            f.write(json.dumps({"epoch": i / 10, "step": i, "loss": 2.0 / i, "lr": 0.1,
                                "samples_per_s": 1000.0}) + "\n")
    files = load_run(run)
    assert report_plots.uses_steps(files)
    fig = report_plots.curves_figure(files)
    for ax in fig.axes:
        if ax.get_xlabel():
            assert set(_integer_ticks(ax)) >= {1.0, 2.0}, ax.get_title()


def test_a_long_run_draws_per_epoch_curves_with_integer_ticks(tmp_path):
    files = load_run(make_run(tmp_path / "run", epochs=7))
    assert not report_plots.uses_steps(files)
    fig = report_plots.curves_figure(files)
    loss_ax = next(ax for ax in fig.axes if ax.get_title() == "loss")
    assert {"train loss (per epoch)", "val loss (per epoch)"} <= set(_labels(loss_ax))
    for ax in fig.axes:
        if ax.get_xlabel():
            assert set(_integer_ticks(ax)) <= set(range(0, 9))
    _check_every_panel_is_labelled(fig)


def test_a_partial_epoch_sits_where_it_stopped(tmp_path):
    run_dir = make_run(tmp_path / "run", epochs=2)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"epoch": 3, "step": 25, "train_loss": 0.5, "val_loss": 0.6, "partial": True,
                            "epoch_fraction": 0.5, "policy": "sync"}) + "\n")
    fig = report_plots.curves_figure(load_run(run_dir))
    loss_ax = next(ax for ax in fig.axes if ax.get_title() == "loss")
    val = next(ln for ln in loss_ax.get_lines() if ln.get_label() == "val loss (per epoch)")
    assert list(val.get_xdata()) == [1.0, 2.0, 2.5]
    assert "+ a partial one" in fig._suptitle.get_text()


def test_lanes_plot_says_what_its_throughput_is_next_to_the_runs(tmp_path):
    files = load_run(make_run(tmp_path / "run", epochs=3, ranks=2))
    fig = report_plots.lanes_figure(files)
    (ax,) = fig.axes
    assert ax.get_ylabel() == "samples/s while computing"
    labels = _labels(ax)
    assert "CPU lane: samples/s while computing" in labels and "GPU lane: samples/s while computing" in labels
    run_rate = report_plots.run_throughput(files)      # median of epochs 2+ of metrics.jsonl
    assert run_rate == pytest.approx(1002.5)
    run_label = next(t for t in labels if t.startswith("run: "))
    assert "1,002 samples/s over step wall time" in run_label or "1,003 samples/s over step wall time" in run_label
    line = next(ln for ln in ax.get_lines() if ln.get_label() == run_label)
    assert line.get_ydata()[0] == pytest.approx(run_rate / 3)       # 3 lanes over 2 ranks
    _check_every_panel_is_labelled(fig)


def test_rank_time_and_sweep_panels_have_labels_and_legends(tmp_path):
    fig = report_plots.rank_time_figure(load_run(make_run(tmp_path / "run")))
    _check_every_panel_is_labelled(fig)
    assert [ax.get_xlabel() for ax in fig.axes] == ["epoch", "rank"]
    from hpc_rlx.observe.run_files import sweep_rows
    fig = report_plots.sweep_figure(sweep_rows(make_sweep(tmp_path / "sweep")))
    _check_every_panel_is_labelled(fig)
    assert _labels(fig.axes[0]) == ["best point", "other points"]
