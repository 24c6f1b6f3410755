"""What a run or sweep directory holds, read back, and the numbers derived from it (pure).

Reads metrics.jsonl (epoch records), steps.jsonl (per-step records at a bounded rate),
summary.json and a sweep's point directories; works on a run that is still going (no
summary.json yet) with what is there. `hpc_rlx.report` prints the text, `observe.plots` draws.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.base.errors import HpcRlxError
from hpc_rlx.observe.step_log import read_steps
from hpc_rlx.observe.sweep_table import collect

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
    def __init__(self, run_dir: Path, metrics: list[dict], summary: dict | None,
                 steps: list[dict] | None = None):
        self.dir, self.metrics, self.summary = run_dir, metrics, summary
        self.steps = list(steps or [])      # steps.jsonl: per-step records

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
    # epoch records; event records (a resumed segment's start) are not epochs
    metrics = [r for r in read_metrics(run_dir / names.METRICS) if "event" not in r]
    summary = None
    spath = run_dir / names.SUMMARY
    if spath.is_file():
        try:
            summary = json.loads(spath.read_text())
        except json.JSONDecodeError as e:
            raise HpcRlxError(f"{spath} is not valid JSON: {e}") from e
    if not metrics and summary is None:
        raise HpcRlxError(f"{run_dir} has neither metrics.jsonl nor summary.json: not a run "
                          f"directory (or the run has not finished an epoch yet)")
    return RunFiles(run_dir, metrics, summary, read_steps(run_dir / names.STEPS))


def is_sweep_dir(path) -> bool:
    path = Path(path)
    if (path / "sweep_summary.json").is_file():
        return True
    if (path / names.METRICS).exists() or (path / names.SUMMARY).exists():
        return False
    return any((p / names.SUMMARY).is_file() or (p / names.METRICS).is_file()
               for p in path.iterdir() if p.is_dir())


def _is_point(p: Path) -> bool:
    return any((p / f).is_file() for f in (names.SUMMARY, names.METRICS, names.OVERRIDES))


def sweep_rows(sweep_dir) -> list[dict]:
    """The sweep's points (sub-directories that are runs), with the overrides that differ
    between points in `varied`."""
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
