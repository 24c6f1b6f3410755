"""The PNG plots of a run or sweep directory (matplotlib's object API on the Agg canvas: no
pyplot state, no display needed).

- `curves.png`: loss, accuracy, and throughput with the learning rate, against the epoch
  (integer ticks). A run of fewer than `FEW_EPOCHS` epochs draws its training curves from the
  per-step records of steps.jsonl (validation stays one point per epoch); longer runs, or runs
  without steps.jsonl, from the epoch records of metrics.jsonl.
- `rank_time.png`: per rank, compute / communication / data / validation / checkpoint /
  other seconds per epoch (stacked), and the same summed over the run.
- `lanes.png`: every lane's samples/s while computing (samples over the lane's busy time),
  next to the run's throughput per lane (all samples over the step wall time, divided by the
  lanes): the gap is the time lanes spent outside computing (communication, waiting).
- `sweep.png` (a sweep directory): the final metrics of every point.

Every panel has axis labels and a legend. The `*_figure` functions return the Figure (tests
inspect it), the `plot_*` ones write the PNG.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.observe.run_files import (
    MAX_GROUPED_RANKS,
    PARTS,
    RunFiles,
    bin_epochs,
    is_sweep_dir,
    lane_rates,
    load_run,
    rank_epochs,
    rank_totals,
    slowest_rank,
    sweep_rows,
)

FEW_EPOCHS = 5      # fewer epochs than this: training curves from the per-step log


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(w, h), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> Path | None:
    if fig is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp)
    tmp.replace(path)
    return path


def _integer_epochs(ax, last_epoch: float | None = None) -> None:
    """Integer epoch ticks; the axis reaches `last_epoch`, so per-step curves that end just
    before an epoch boundary (1.98) still show that epoch's tick."""
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    if last_epoch:
        lo, hi = ax.get_xlim()
        if hi < last_epoch:
            ax.set_xlim(lo, last_epoch + 0.02 * max(last_epoch - lo, 1.0))
    ax.set_xlabel("epoch")


def epoch_x(rec: dict) -> float:
    """Where an epoch record sits on the epoch axis: its end (epoch 3 ends at 3); a partial
    epoch where it stopped."""
    e = float(rec.get("epoch") or 0)
    if rec.get("partial") and isinstance(rec.get("epoch_fraction"), (int, float)):
        return e - 1 + float(rec["epoch_fraction"])
    return e


def _series(records: list[dict], key: str, x=epoch_x) -> tuple[list, list]:
    xs, ys = [], []
    for m in records:
        v = m.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(x(m))
            ys.append(v)
    return xs, ys


def _step_x(rec: dict) -> float:
    return float(rec.get("epoch") or 0.0)


CURVE_PANELS = (("loss", ("train_loss", "val_loss")), ("accuracy", ("train_accuracy", "val_accuracy")),
                ("IoU", ("val_iou",)), ("MAE", ("val_mae",)))


def curve_panels(metrics: list[dict]) -> dict[str, tuple]:
    """The metric panels a run has values for: a regression run has no accuracy panel."""
    return {title: keys for title, keys in CURVE_PANELS
            if any(_series(metrics, k)[0] for k in keys)}


def uses_steps(files: RunFiles) -> bool:
    """Whether the training curves come from steps.jsonl (few epochs, and records there)."""
    full = [m for m in files.metrics if not m.get("partial")]
    return len(full) < FEW_EPOCHS and len(files.steps) >= 2


def curves_figure(files: RunFiles):
    m = files.metrics
    if not m and not files.steps:
        return None
    per_step = uses_steps(files)
    last_epoch = max(_series(m, "epoch")[0], default=None)
    panels = curve_panels(m) or {"loss": ("train_loss", "val_loss")}
    fig = _figure(13 * (len(panels) + 1) / 3, 4)
    axes = fig.subplots(1, len(panels) + 1, squeeze=False)[0]
    for ax, (title, keys) in zip(axes[:-1], panels.items()):
        if per_step and title == "loss":
            xs, ys = _series(files.steps, "loss", _step_x)
            ax.plot(xs, ys, "-", lw=1, label="train loss (per step)")
        for key, style in zip(keys, ("-o", "-s")):
            if per_step and key == "train_loss":
                continue
            xs, ys = _series(m, key)
            if xs:
                ax.plot(xs, ys, style, ms=4, label=key.replace("_", " ") + " (per epoch)")
        ax.set_title(title)
        ax.set_ylabel(title)
        _integer_epochs(ax, last_epoch)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[-1]
    source, x = (files.steps, _step_x) if per_step else (m, epoch_x)
    xs, ys = _series(source, "samples_per_s", x)
    handles = ax.plot(xs, ys, "-" if per_step else "-o", ms=3, color="#444444",
                      label="samples/s (all ranks, step wall time)")
    ax.set_title("throughput and learning rate")
    ax.set_ylabel("samples/s")
    _integer_epochs(ax, last_epoch)
    ax.grid(alpha=0.3)
    lx, ly = _series(source, "lr", x)
    if lx:
        ax2 = ax.twinx()
        handles += ax2.plot(lx, ly, "--", color="#d62728", label="learning rate")
        ax2.set_ylabel("learning rate", color="#d62728")
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="lower right")
    s = files.summary or {}
    full = len([r for r in m if not r.get("partial")])
    fig.suptitle(f"{files.dir.name}: {s.get('world_size', '?')} ranks, {full} epochs"
                 f"{' + a partial one' if m and m[-1].get('partial') else ''}, "
                 f"{m[-1].get('policy', '') if m else ''}"
                 f"{'; training curves per step (steps.jsonl)' if per_step else ''}")
    fig.tight_layout()
    return fig


def _parts_legend(ax, **kw) -> None:
    from matplotlib.patches import Patch
    ax.legend([Patch(color=c) for _, _, c in PARTS], [name for _, name, _ in PARTS], **kw)


def rank_time_figure(files: RunFiles):
    per = rank_epochs(files)
    totals = rank_totals(files)
    if not per and not totals:
        return None
    ranks = sorted(per) if per else sorted(totals)
    fig = _figure(14, 8)
    ax_ep, ax_tot = fig.subplots(2, 1, gridspec_kw={"height_ratios": [3, 2]})

    # Top: per epoch, one stacked bar per rank (the slowest ranks only when there are many).
    shown = ranks
    if len(ranks) > MAX_GROUPED_RANKS:
        # the slowest computing ranks, and the fastest one for contrast
        by_compute = sorted(ranks, key=lambda r: -totals[r]["compute_s"])
        shown = sorted(by_compute[:MAX_GROUPED_RANKS - 1] + by_compute[-1:])
    labels = None
    width = 0.84 / max(1, len(shown))
    for j, r in enumerate(shown):
        labels, groups = bin_epochs(per.get(r, []))
        xs = [g + (j - (len(shown) - 1) / 2) * width for g in range(len(groups))]
        bottom = [0.0] * len(groups)
        for key, _, color in PARTS:
            vals = [g[key] for g in groups]
            ax_ep.bar(xs, vals, width * 0.92, bottom=bottom, color=color, edgecolor="white", linewidth=0.3)
            bottom = [b + v for b, v in zip(bottom, vals)]
        if len(shown) <= 4 and len(groups) <= 12:
            for x, b in zip(xs, bottom):
                ax_ep.text(x, b, f"r{r}", ha="center", va="bottom", fontsize=7)
    if labels:
        ax_ep.set_xticks(range(len(labels)))
        ax_ep.set_xticklabels(labels, rotation=0 if len(labels) <= 20 else 60, fontsize=8)
    note = "" if shown == ranks else f" (the {len(shown) - 1} slowest and the fastest of {len(ranks)})"
    ax_ep.set_title(f"time per epoch, one bar per rank {', '.join(f'r{r}' for r in shown[:8])}"
                    f"{'...' if len(shown) > 8 else ''}{note}")
    ax_ep.set_xlabel("epoch")
    ax_ep.set_ylabel("seconds")
    _parts_legend(ax_ep, ncol=6, fontsize=8, loc="upper right")
    ax_ep.grid(axis="y", alpha=0.3)

    # Bottom: whole run per rank (every rank), which rank was slow at a glance.
    xs = list(range(len(ranks)))
    bottom = [0.0] * len(ranks)
    for key, _, color in PARTS:
        vals = [totals.get(r, {}).get(key, 0.0) for r in ranks]
        ax_tot.bar(xs, vals, 0.7, bottom=bottom, color=color, edgecolor="white", linewidth=0.3)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax_tot.set_xticks(xs)
    ax_tot.set_xticklabels([f"r{r}" for r in ranks], fontsize=8 if len(ranks) <= 32 else 6,
                           rotation=0 if len(ranks) <= 32 else 90)
    slow = slowest_rank(files)
    title = "whole run per rank"
    if slow:
        title += f": rank {slow[0]} computes slowest ({slow[1]:.2f}x the median per sample)"
    ax_tot.set_title(title)
    ax_tot.set_xlabel("rank")
    ax_tot.set_ylabel("seconds")
    _parts_legend(ax_tot, ncol=6, fontsize=8, loc="upper right")
    ax_tot.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def run_throughput(files: RunFiles) -> float | None:
    """The run's samples/s over step wall time: the median epoch after the first (warm-up)."""
    rates = [r["samples_per_s"] for r in files.metrics
             if isinstance(r.get("samples_per_s"), (int, float)) and not r.get("partial")]
    rates = rates[1:] or rates
    return statistics.median(rates) if rates else None


def lanes_figure(files: RunFiles):
    from matplotlib.patches import Patch
    rows = lane_rates(files)
    if not rows:
        return None
    fig = _figure(max(7, min(20, 0.5 * len(rows) + 4)), 4.5)
    ax = fig.subplots(1, 1)
    xs = list(range(len(rows)))
    gpu = [lane.startswith("cuda") for _, lane, _, _ in rows]
    ax.bar(xs, [r[2] for r in rows], 0.7, color=["#2ca02c" if g else "#1f77b4" for g in gpu])
    total = sum(r[3] for r in rows) or 1
    if len(rows) <= 24:
        for x, (_, _, rate, n) in zip(xs, rows):
            ax.text(x, rate, f"{100 * n / total:.0f}%", ha="center", va="bottom", fontsize=8)
    handles = [Patch(color="#1f77b4", label="CPU lane: samples/s while computing")]
    if any(gpu):
        handles.append(Patch(color="#2ca02c", label="GPU lane: samples/s while computing"))
    run_rate = run_throughput(files)
    if run_rate:
        per_lane = run_rate / len(rows)
        handles.append(ax.axhline(per_lane, color="#d62728", ls="--", lw=1,
                                  label=f"run: {run_rate:,.0f} samples/s over step wall time "
                                        f"= {per_lane:,.0f} per lane"))
    ax.set_xticks(xs)
    ax.set_xticklabels([f"r{r}:{lane}" for r, lane, _, _ in rows],
                       rotation=0 if len(rows) <= 8 else 60, fontsize=8)
    ax.set_xlabel("rank:lane (bar label: share of all samples)")
    ax.set_ylabel("samples/s while computing")
    ax.set_title("lane throughput while computing (busy time only: no communication or waiting)",
                 fontsize=10)
    ax.legend(handles=handles, fontsize=8, loc="best", framealpha=0.9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def sweep_figure(rows: list[dict]):
    from matplotlib.patches import Patch
    keys = [k for k in ("val_loss", "val_accuracy", "val_iou", "val_mae", "train_loss")
            if any(isinstance(r.get(k), (int, float)) for r in rows)][:2]
    if not keys:
        return None
    labels = [f"{r['point']}: {r.get('varied') or r.get('overrides') or ''}"[:60] for r in rows]
    fig = _figure(12, max(3.0, 0.35 * len(rows) + 1.5))
    axes = fig.subplots(1, len(keys), sharey=True, squeeze=False)[0]
    ys = list(range(len(rows)))
    for ax, key in zip(axes, keys):
        vals = [r.get(key) if isinstance(r.get(key), (int, float)) else float("nan") for r in rows]
        finite = [v for v in vals if math.isfinite(v)]
        best = (min(finite) if "loss" in key or "mae" in key else max(finite)) if finite else None
        colors = ["#d62728" if v == best else "#1f77b4" for v in vals]
        ax.barh(ys, [0 if not math.isfinite(v) else v for v in vals], color=colors)
        for y, v in zip(ys, vals):
            ax.text(v if math.isfinite(v) else 0, y, f" {v:.4g}" if math.isfinite(v) else " missing",
                    va="center", fontsize=8)
        ax.set_title(f"final {key}")
        ax.set_xlabel(key)
        ax.set_ylabel("sweep point")
        ax.legend([Patch(color="#d62728"), Patch(color="#1f77b4")], ["best point", "other points"],
                  fontsize=8, loc="lower right")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(ys)
    axes[0].set_yticklabels(labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.tight_layout()
    return fig


def plot_curves(files: RunFiles, path: Path) -> Path | None:
    return _save(curves_figure(files), path)


def plot_rank_time(files: RunFiles, path: Path) -> Path | None:
    return _save(rank_time_figure(files), path)


def plot_lanes(files: RunFiles, path: Path) -> Path | None:
    return _save(lanes_figure(files), path)


def plot_sweep(rows: list[dict], path: Path) -> Path | None:
    return _save(sweep_figure(rows), path)


def write_plots(run_dir, out_dir=None) -> list[Path]:
    """Render the PNGs of a run directory into OUT_DIR (default RUN_DIR/plots), or of a sweep
    directory (default: `sweep.png` next to sweep_summary.md, so no new sub-directory looks
    like a sweep point)."""
    run_dir = Path(run_dir)
    if is_sweep_dir(run_dir):
        p = plot_sweep(sweep_rows(run_dir), Path(out_dir or run_dir) / "sweep.png")
        return [p] if p else []
    out = Path(out_dir) if out_dir else run_dir / names.PLOTS
    files = load_run(run_dir)
    made = [plot_curves(files, out / "curves.png"), plot_rank_time(files, out / "rank_time.png"),
            plot_lanes(files, out / "lanes.png")]
    return [p for p in made if p is not None]
