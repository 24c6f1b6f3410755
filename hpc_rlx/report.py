"""Plots and a text summary of a run (or of a sweep) from the files it left behind.

    python -m hpc_rlx.report outputs/2026-01-01_12-00-00          # a run directory
    python -m hpc_rlx.report multirun/2026-01-01_12-00-00         # a sweep directory
    python -m hpc_rlx.report RUN_DIR --no-plots                   # text only

A run directory gets `plots/curves.png` (loss, accuracy and throughput per epoch),
`plots/rank_time.png` (per rank: compute / communication / data / evaluation / checkpoint /
other seconds per epoch, stacked, and the same summed over the run) and `plots/lanes.png`
(samples/s of every lane of every rank). A sweep directory gets `plots/sweep.png` (the final
metrics of every point). Reads only metrics.jsonl, summary.json and the sweep's point
directories; works on a run that is still going (no summary.json yet) with what is there.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from .errors import HpcRlxError

# One colour per kind of time, the same in every plot.
PARTS = (
    ("compute_s", "compute", "#1f77b4"),
    ("comm_s", "communication", "#ff7f0e"),
    ("data_s", "data loading", "#2ca02c"),
    ("eval_s", "validation", "#9467bd"),
    ("checkpoint_s", "checkpoint", "#8c564b"),
    ("other_s", "other", "#c7c7c7"),
)
MAX_EPOCH_GROUPS = 40      # more epochs than this are binned, so bars stay readable
MAX_GROUPED_RANKS = 8      # more ranks than this: per-epoch bars show only the slowest ranks


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------

class RunFiles:
    def __init__(self, run_dir: Path, metrics: list[dict], summary: dict | None):
        self.dir, self.metrics, self.summary = run_dir, metrics, summary

    @property
    def ranks(self) -> list[dict]:
        return list((self.summary or {}).get("ranks") or [])


def read_metrics(path: Path) -> list[dict]:
    rows = []
    if not path.is_file():
        return rows
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            # the last line of a run that is being written (or was killed) may be partial
            if n < len(lines):
                raise HpcRlxError(f"{path}: line {n} is not valid JSON: {line[:80]!r}") from None
    return rows


def load_run(run_dir) -> RunFiles:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise HpcRlxError(f"run directory {run_dir} does not exist")
    metrics = read_metrics(run_dir / "metrics.jsonl")
    summary = None
    spath = run_dir / "summary.json"
    if spath.is_file():
        try:
            summary = json.loads(spath.read_text())
        except json.JSONDecodeError as e:
            raise HpcRlxError(f"{spath} is not valid JSON: {e}") from e
    if not metrics and summary is None:
        raise HpcRlxError(f"{run_dir} has neither metrics.jsonl nor summary.json: not a run "
                          f"directory (or the run has not finished an epoch yet)")
    return RunFiles(run_dir, metrics, summary)


def is_sweep_dir(path) -> bool:
    path = Path(path)
    if (path / "sweep_summary.json").is_file():
        return True
    if (path / "metrics.jsonl").exists() or (path / "summary.json").exists():
        return False
    return any((p / "summary.json").is_file() or (p / "metrics.jsonl").is_file()
               for p in path.iterdir() if p.is_dir())


def _is_point(p: Path) -> bool:
    return any((p / f).is_file() for f in ("summary.json", "metrics.jsonl", "overrides.txt"))


def sweep_rows(sweep_dir) -> list[dict]:
    """The sweep's points (sub-directories that are runs), with the overrides that differ
    between points in `varied`."""
    from .sweep import collect
    sweep_dir = Path(sweep_dir)
    rows = [r for r in collect(sweep_dir) if _is_point(sweep_dir / r["point"])]
    varied = varied_overrides([r.get("overrides") or "" for r in rows])
    for r, v in zip(rows, varied):
        r["varied"] = v
    return rows


def varied_overrides(overrides: list[str]) -> list[str]:
    """Per point, only the `key=value` overrides whose value is not the same for all points."""
    parsed = [dict(tok.split("=", 1) if "=" in tok else (tok, "") for tok in o.split()) for o in overrides]
    keys = []
    for d in parsed:
        keys += [k for k in d if k not in keys]
    differ = [k for k in keys if len({d.get(k) for d in parsed}) > 1]
    return [" ".join(f"{k}={d[k]}" for k in differ if k in d) for d in parsed]


# --------------------------------------------------------------------------------------
# Derived numbers (pure)
# --------------------------------------------------------------------------------------

def epoch_parts(rec: dict) -> dict:
    """Seconds per kind for one rank-epoch record; `other` is the unexplained rest of the wall."""
    out = {k: float(rec.get(k) or 0.0) for k, _, _ in PARTS if k != "other_s"}
    wall = float(rec.get("epoch_s") or 0.0)
    out["other_s"] = max(0.0, wall - sum(out.values()))
    return out


def rank_epochs(files: RunFiles) -> dict[int, list[dict]]:
    """Per rank, per epoch, the time split. Falls back to rank 0's metrics.jsonl records
    (runs from before per-rank epochs were recorded, or a run still going)."""
    per = {}
    for r in files.ranks:
        if r.get("epochs"):
            per[int(r.get("rank", len(per)))] = [dict(e, **epoch_parts(e)) for e in r["epochs"]]
    if not per and files.metrics:
        per[0] = [dict(epoch=m.get("epoch"), **epoch_parts(m)) for m in files.metrics]
    return per


def rank_totals(files: RunFiles) -> dict[int, dict]:
    """Per rank, the time split summed over the run."""
    out = {}
    for r, epochs in rank_epochs(files).items():
        out[r] = {k: sum(e[k] for e in epochs) for k, _, _ in PARTS}
    if not out:
        for i, r in enumerate(files.ranks):
            out[int(r.get("rank", i))] = {k: float(r.get(k) or 0.0) for k, _, _ in PARTS}
    return out


def bin_epochs(epochs: list[dict], max_groups: int = MAX_EPOCH_GROUPS) -> tuple[list[str], list[dict]]:
    """Sum consecutive epochs into at most `max_groups` groups; returns (labels, parts)."""
    n = len(epochs)
    size = max(1, math.ceil(n / max_groups))
    labels, groups = [], []
    for lo in range(0, n, size):
        chunk = epochs[lo: lo + size]
        first, last = chunk[0].get("epoch", lo + 1), chunk[-1].get("epoch", lo + len(chunk))
        labels.append(str(first) if first == last else f"{first}-{last}")
        groups.append({k: sum(e[k] for e in chunk) for k, _, _ in PARTS})
    return labels, groups


def slowest_rank(files: RunFiles) -> tuple[int, float] | None:
    """(rank, its compute time / the median rank's) by compute seconds per sample."""
    rates = {}
    for i, r in enumerate(files.ranks):
        samples = float(r.get("samples") or 0)
        if samples > 0 and r.get("compute_s"):
            rates[int(r.get("rank", i))] = float(r["compute_s"]) / samples
    if len(rates) < 2:
        return None
    med = statistics.median(rates.values())
    worst = max(rates, key=rates.get)
    return worst, (rates[worst] / med if med > 0 else float("inf"))


def cpu_use(files: RunFiles) -> dict[int, float]:
    """Per rank: CPU seconds / wall seconds (1.0 = one busy core), over the epochs after the
    first when there are several (the first also holds start-up and the data load's I/O)."""
    out = {}
    for i, r in enumerate(files.ranks):
        eps = [e for e in (r.get("epochs") or []) if "cpu_s" in e]
        eps = eps[1:] or eps
        wall = sum(float(e.get("epoch_s") or 0.0) for e in eps)
        if wall > 0:
            out[int(r.get("rank", i))] = sum(float(e["cpu_s"]) for e in eps) / wall
    return out


def lane_rates(files: RunFiles) -> list[tuple[int, str, float, int]]:
    """(rank, lane, samples/s while busy, samples) for every lane of every rank."""
    out = []
    for i, r in enumerate(files.ranks):
        busy = r.get("lane_busy_s") or {}
        for lane, n in (r.get("lane_samples") or {}).items():
            b = float(busy.get(lane) or 0.0)
            out.append((int(r.get("rank", i)), lane, (n / b) if b > 0 else 0.0, int(n)))
    return out


# --------------------------------------------------------------------------------------
# Plots (matplotlib's object API on the Agg canvas: no pyplot state, no display needed)
# --------------------------------------------------------------------------------------

def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(w, h), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp)
    tmp.replace(path)
    return path


def _series(metrics: list[dict], key: str) -> tuple[list, list]:
    xs, ys = [], []
    for m in metrics:
        v = m.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(m.get("epoch"))
            ys.append(v)
    return xs, ys


CURVE_PANELS = (("loss", ("train_loss", "val_loss")), ("accuracy", ("train_accuracy", "val_accuracy")))


def curve_panels(metrics: list[dict]) -> dict[str, tuple]:
    """The metric panels a run has values for: a regression run has no accuracy panel."""
    return {title: keys for title, keys in CURVE_PANELS
            if any(_series(metrics, k)[0] for k in keys)}


def plot_curves(files: RunFiles, path: Path) -> Path | None:
    m = files.metrics
    if not m:
        return None
    panels = curve_panels(m)
    fig = _figure(13 * (len(panels) + 1) / 3, 4)
    axes = fig.subplots(1, len(panels) + 1, squeeze=False)[0]
    for ax, (title, keys) in zip(axes[:-1], panels.items()):
        for key, style in zip(keys, ("-o", "-s")):
            xs, ys = _series(m, key)
            if xs:
                ax.plot(xs, ys, style, ms=3, label=key.replace("_", " "))
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    xs, ys = _series(m, "samples_per_s")
    ax = axes[-1]
    if xs:
        ax.plot(xs, ys, "-o", ms=3, color="#444444", label="samples/s")
    ax.set_title("throughput (all ranks, step time)")
    ax.set_xlabel("epoch")
    ax.set_ylabel("samples/s")
    ax.grid(alpha=0.3)
    lx, ly = _series(m, "lr")
    if lx:
        ax2 = ax.twinx()
        ax2.plot(lx, ly, "--", color="#d62728", label="lr")
        ax2.set_ylabel("learning rate", color="#d62728")
    s = files.summary or {}
    fig.suptitle(f"{files.dir.name}: {s.get('world_size', '?')} ranks, "
                 f"{len(m)} epochs, {m[-1].get('policy', '')}")
    fig.tight_layout()
    return _save(fig, path)


def plot_rank_time(files: RunFiles, path: Path) -> Path | None:
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
        for key, name, color in PARTS:
            vals = [g[key] for g in groups]
            ax_ep.bar(xs, vals, width * 0.92, bottom=bottom, color=color,
                      label=name if j == 0 else None, edgecolor="white", linewidth=0.3)
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
    ax_ep.legend(ncol=6, fontsize=8, loc="upper right")
    ax_ep.grid(axis="y", alpha=0.3)

    # Bottom: whole run per rank (every rank), which rank was slow at a glance.
    xs = list(range(len(ranks)))
    bottom = [0.0] * len(ranks)
    for key, name, color in PARTS:
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
    ax_tot.set_ylabel("seconds")
    ax_tot.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_lanes(files: RunFiles, path: Path) -> Path | None:
    rows = lane_rates(files)
    if not rows:
        return None
    fig = _figure(max(7, min(20, 0.5 * len(rows) + 4)), 4.5)
    ax = fig.subplots(1, 1)
    xs = list(range(len(rows)))
    colors = ["#2ca02c" if lane.startswith("cuda") else "#1f77b4" for _, lane, _, _ in rows]
    ax.bar(xs, [r[2] for r in rows], 0.7, color=colors)
    total = sum(r[3] for r in rows) or 1
    if len(rows) <= 24:
        for x, (_, _, rate, n) in zip(xs, rows):
            ax.text(x, rate, f"{100 * n / total:.0f}%", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"r{r}:{lane}" for r, lane, _, _ in rows],
                       rotation=0 if len(rows) <= 8 else 60, fontsize=8)
    ax.set_ylabel("samples/s while computing")
    ax.set_title("lane throughput (label: share of all samples)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_sweep(rows: list[dict], path: Path) -> Path | None:
    keys = [k for k in ("val_loss", "val_accuracy", "train_loss")
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
        best = (min(finite) if "loss" in key else max(finite)) if finite else None
        colors = ["#d62728" if v == best else "#1f77b4" for v in vals]
        ax.barh(ys, [0 if not math.isfinite(v) else v for v in vals], color=colors)
        for y, v in zip(ys, vals):
            ax.text(v if math.isfinite(v) else 0, y, f" {v:.4g}" if math.isfinite(v) else " missing",
                    va="center", fontsize=8)
        ax.set_title(f"final {key} (best in red)")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(ys)
    axes[0].set_yticklabels(labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.tight_layout()
    return _save(fig, path)


def write_plots(run_dir, out_dir=None) -> list[Path]:
    """Render the PNGs of a run directory into OUT_DIR (default RUN_DIR/plots), or of a sweep
    directory (default: `sweep.png` next to sweep_summary.md, so no new sub-directory looks
    like a sweep point)."""
    run_dir = Path(run_dir)
    if is_sweep_dir(run_dir):
        p = plot_sweep(sweep_rows(run_dir), Path(out_dir or run_dir) / "sweep.png")
        return [p] if p else []
    out = Path(out_dir) if out_dir else run_dir / "plots"
    files = load_run(run_dir)
    made = [plot_curves(files, out / "curves.png"), plot_rank_time(files, out / "rank_time.png"),
            plot_lanes(files, out / "lanes.png")]
    return [p for p in made if p is not None]


# --------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------

def _f(v, spec: str = ".4f") -> str:
    return "-" if not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def run_text(files: RunFiles) -> str:
    s = files.summary or {}
    m = files.metrics
    lines = []
    status = s.get("status", "running or interrupted (no summary.json)")
    lines.append(f"run {files.dir}: {status}, {s.get('epochs_completed', len(m))} epochs, "
                 f"{s.get('steps', m[-1].get('step') if m else '?')} steps, "
                 f"{s.get('world_size', '?')} ranks, policy {m[-1].get('policy', '?') if m else '?'}")
    final = s.get("final") or (m[-1] if m else {})
    # a regression run has no accuracy: no "val_accuracy -" either
    acc = f"  val_accuracy {_f(final.get('val_accuracy'))}" if "val_accuracy" in final else ""
    lines.append(f"final: train_loss {_f(final.get('train_loss'))}  val_loss {_f(final.get('val_loss'))}"
                 f"{acc}")
    rates = [r["samples_per_s"] for r in m if isinstance(r.get("samples_per_s"), (int, float))]
    if rates:
        later = rates[1:] or rates   # the first epoch pays warm-up
        lines.append(f"throughput: {statistics.median(later):,.0f} samples/s median over "
                     f"{'epochs 2+' if len(rates) > 1 else 'the epoch'} (first epoch {rates[0]:,.0f})")
    totals = rank_totals(files)
    if files.ranks:
        lines.append("per rank (seconds over the run):")
        cpu = cpu_use(files)
        lines.append(f"  {'rank':>4} {'host':<12} {'lanes':<14} {'thr':>3} {'samples':>9} {'compute':>8} "
                     f"{'comm':>8} {'data':>8} {'ckpt':>7} {'wall':>8} {'cpu%':>5}")
        for i, r in enumerate(files.ranks):
            k = int(r.get("rank", i))
            t = totals.get(k, {})
            lines.append(
                f"  {k:>4} {str(r.get('host', ''))[:12]:<12} {','.join(r.get('lanes') or [])[:14]:<14} "
                f"{_f(r.get('threads'), 'd') if isinstance(r.get('threads'), int) else '-':>3} "
                f"{int(r.get('samples') or 0):>9} {_f(r.get('compute_s'), '.3f'):>8} {_f(r.get('comm_s'), '.3f'):>8} "
                f"{_f(t.get('data_s', r.get('data_s')), '.3f'):>8} {_f(r.get('checkpoint_s'), '.3f'):>7} "
                f"{_f(r.get('wall_s'), '.2f'):>8} "
                f"{(f'{100 * cpu[k]:.0f}' if k in cpu else '-'):>5}")
        slow = slowest_rank(files)
        if slow:
            rank, ratio = slow
            verdict = ("balanced" if ratio < 1.1 else
                       f"rank {rank} is the slowest: {ratio:.2f}x the median compute time per sample; "
                       f"the other ranks wait for it inside the allreduce (their comm time)")
            lines.append(f"balance: {verdict}")
        starved = sorted(k for k, c in cpu.items() if c < 0.7)
        if starved:
            lines.append(f"cpu: rank{'s' if len(starved) > 1 else ''} {_ranges(starved)} used under 70% "
                         f"of a core while training: "
                         f"they waited for a core (another job on the node, or ranks x threads > cores; "
                         f"see train.threads_per_rank and python -m hpc_rlx.doctor)")
        comm_share = [t["comm_s"] / max(1e-12, t["comm_s"] + t["compute_s"]) for t in totals.values()
                      if t["comm_s"] + t["compute_s"] > 0]
        if comm_share:
            lines.append(f"communication: {100 * min(comm_share):.0f}-{100 * max(comm_share):.0f}% "
                         f"of compute+comm time across ranks")
    lanes = lane_rates(files)
    if len(lanes) > 1 or any(lane != "cpu0" for _, lane, _, _ in lanes):
        lines.append("lanes: " + "  ".join(f"r{r}:{lane} {rate:,.0f}/s ({n} samples)"
                                           for r, lane, rate, n in lanes[:16])
                     + ("  ..." if len(lanes) > 16 else ""))
    tpath = files.dir / "trace.json"
    if tpath.is_file():
        lines.append(f"trace: {tpath} (open in https://ui.perfetto.dev or chrome://tracing)")
        lines.extend(trace_lines(tpath))
    return "\n".join(lines)


STEP_SPANS = ("data.batch", "forward_backward", "allreduce", "wait", "optimizer", "step")


def trace_per_step(doc: dict) -> dict[int, dict[str, float]]:
    """Per rank: milliseconds per step spent in each step-level span (from a merged trace)."""
    tot: dict[int, dict[str, float]] = {}
    steps: dict[int, int] = {}
    for e in doc.get("traceEvents", []):
        if e.get("ph") != "X" or e["name"] not in STEP_SPANS:
            continue
        d = tot.setdefault(e["pid"], {})
        d[e["name"]] = d.get(e["name"], 0.0) + e["dur"] * 1e-3
        if e["name"] == "step":
            steps[e["pid"]] = steps.get(e["pid"], 0) + 1
    return {r: {k: v / steps[r] for k, v in d.items()} for r, d in tot.items() if steps.get(r)}


def trace_lines(path: Path, max_ranks: int = 8) -> list[str]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return [f"  (trace unreadable: {e})"]
    per = trace_per_step(doc)
    if not per:
        # policies without per-step spans (cadence, async): totals per span name instead
        from .trace import summarize
        tot = sorted(summarize(doc).items(), key=lambda kv: -kv[1])
        tot = [(k, v) for k, v in tot if not k.startswith("epoch ")][:8]
        return ["  seconds, all ranks: " + "  ".join(f"{k} {v:.3f}" for k, v in tot)] if tot else []
    out = ["  ms per step  " + " ".join(f"{k:>16}" for k in STEP_SPANS)]
    for r in sorted(per)[:max_ranks]:
        out.append(f"  rank {r:<6} " + " ".join(f"{per[r].get(k, 0.0):>16.3f}" for k in STEP_SPANS))
    if len(per) > max_ranks:
        out.append(f"  ... {len(per) - max_ranks} more ranks")
    return out


def _ranges(ks: list[int]) -> str:
    out, i = [], 0
    while i < len(ks):
        j = i
        while j + 1 < len(ks) and ks[j + 1] == ks[j] + 1:
            j += 1
        out.append(str(ks[i]) if i == j else f"{ks[i]}-{ks[j]}")
        i = j + 1
    return ",".join(out)


def sweep_text(sweep_dir: Path, rows: list[dict]) -> str:
    from .sweep import render
    done = [r for r in rows if isinstance(r.get("val_loss"), (int, float))]
    head = f"sweep {sweep_dir}: {len(rows)} points, {len(done)} with a final val_loss"
    if done:
        best = min(done, key=lambda r: r["val_loss"])
        head += (f"; best val_loss {best['val_loss']:.4f} at point {best['point']} "
                 f"({best.get('varied') or best.get('overrides')})")
    common = ""
    if rows and rows[0].get("overrides"):
        shared = [t for t in rows[0]["overrides"].split() if t not in (rows[0].get("varied") or "").split()]
        common = ("common overrides: " + " ".join(shared) + "\n") if shared else ""
    compact = [dict(r, overrides=r.get("varied", r.get("overrides"))) for r in rows]
    return head + "\n" + common + render(compact)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpc_rlx.report",
                                description="Plots and a text summary of a run or sweep directory.")
    p.add_argument("run_dir", help="a run directory (metrics.jsonl, summary.json) or a sweep directory")
    p.add_argument("--out", default=None, help="where to write the PNGs (default RUN_DIR/plots)")
    p.add_argument("--no-plots", action="store_true", help="print the text summary only")
    p.add_argument("--points", action="store_true",
                   help="for a sweep directory, also (re)write every point's own plots")
    args = p.parse_args(argv)
    try:
        path = Path(args.run_dir)
        if not path.is_dir():
            raise HpcRlxError(f"{path} is not a directory")
        if is_sweep_dir(path):
            print(sweep_text(path, sweep_rows(path)))
        else:
            print(run_text(load_run(path)))
        if not args.no_plots:
            try:
                made = write_plots(path, args.out)
            except ImportError:
                print("plots: skipped, matplotlib is not installed (pip install 'hpc_rlx[report]')")
            else:
                if args.points and is_sweep_dir(path):
                    for r in sweep_rows(path):
                        try:
                            made += write_plots(path / r["point"])
                        except HpcRlxError as e:
                            print(f"point {r['point']}: {e}")
                print("plots: " + (", ".join(str(m) for m in made) if made else "nothing to plot"))
    except HpcRlxError as e:
        print(f"hpc_rlx.report: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
