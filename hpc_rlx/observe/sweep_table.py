"""A sweep's table: every point's overrides and final metrics, read from the point directories
(`sweep_summary.md` and `sweep_summary.json` in the sweep directory). Plain files, no Hydra:
the report and the plots read it too."""

from __future__ import annotations

import json
from pathlib import Path

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.observe.metrics.validation import VAL_KEYS

OPTIONAL = VAL_KEYS[1:]     # reported by some models only (val_accuracy, val_iou, val_mae)
COLUMNS = ("val_loss", *OPTIONAL, "train_loss", "epochs_completed", "status")


def collect(sweep_dir: Path) -> list[dict]:
    rows = []
    # A sweep point is a directory a run wrote into (plots and other folders are not points).
    points = (p for p in sweep_dir.iterdir()
              if p.is_dir() and ((p / names.OVERRIDES).exists() or (p / names.SUMMARY).exists()))
    for point in sorted(points, key=lambda p: (len(p.name), p.name)):
        summary = point / names.SUMMARY
        overrides = point / names.OVERRIDES
        row = {"point": point.name,
               "overrides": overrides.read_text().strip() if overrides.exists() else ""}
        if summary.exists():
            s = json.loads(summary.read_text())
            final = s.get("final") or {}
            # a regression point has no val_accuracy key at all: keep it absent
            row.update({k: final.get(k) for k in ("val_loss", *OPTIONAL, "train_loss")
                        if k in final or k not in OPTIONAL})
            row["epochs_completed"] = s.get("epochs_completed")
            row["status"] = s.get("status")
        else:
            row["status"] = "missing summary.json"
        rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    columns = [c for c in COLUMNS if c not in OPTIONAL or any(c in r for r in rows)]
    head = "| point | overrides | " + " | ".join(columns) + " |"
    sep = "|" + "---|" * (len(columns) + 2)
    lines = [head, sep]
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c)
            cells.append(f"{v:.4f}" if isinstance(v, float) else ("-" if v is None else str(v)))
        lines.append(f"| {r['point']} | {r['overrides']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_summary(sweep_dir: Path) -> Path:
    rows = collect(sweep_dir)
    (sweep_dir / "sweep_summary.json").write_text(json.dumps(rows, indent=1))
    out = sweep_dir / names.SWEEP_SUMMARY
    out.write_text(render(rows))
    return out
