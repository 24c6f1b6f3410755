"""Hydra sweeps under mpirun: every rank runs the points in lockstep, one shared directory per
point, no stray per-rank or per-timestamp directories, and rank 0's summary table at the end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.jobs import explain, mpirun

pytestmark = pytest.mark.mpi


def test_sweep_points_run_in_lockstep_with_one_directory_each(tmp_path, digits_h5):
    proc = mpirun(4, ["-m", "hpc_rlx", "-m", "optim.lr=0.1,0.05", "policy=sync,cadence",
                      f"data.path={digits_h5}", "train.epochs=2", "report.plots=false",
                      "model.hidden=[32]"], timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    # Exactly one sweep directory, and nothing else next to it (no outputs/, no per-rank dirs).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multirun"], explain(proc)
    sweeps = list((tmp_path / "multirun").iterdir())
    assert len(sweeps) == 1, sweeps
    sweep = sweeps[0]
    points = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert points == ["0", "1", "2", "3"]
    expected = {("0.1", "sync"), ("0.1", "cadence"), ("0.05", "sync"), ("0.05", "cadence")}
    seen = set()
    for name in points:
        point = sweep / name
        summary = json.loads((point / "summary.json").read_text())
        assert summary["world_size"] == 4 and summary["status"] == "completed"
        assert len((point / "metrics.jsonl").read_text().splitlines()) == 2
        assert not (point / ".hydra").exists()
        overrides = (point / "overrides.txt").read_text().split()
        lr = next(o.split("=")[1] for o in overrides if o.startswith("optim.lr="))
        policy = next(o.split("=")[1] for o in overrides if o.startswith("policy="))
        assert json.loads((point / "metrics.jsonl").read_text().splitlines()[-1])["policy"] == policy
        seen.add((lr, policy))
    assert seen == expected
    rows = json.loads((sweep / "sweep_summary.json").read_text())
    assert [r["point"] for r in rows] == points
    assert all(r["status"] == "completed" and r["val_accuracy"] is not None for r in rows)
    table = (sweep / "sweep_summary.md").read_text()
    assert table.count("\n| ") == 4 and "policy=cadence" in table and "optim.lr=0.05" in table


def test_a_failing_sweep_point_is_recorded_and_the_others_still_run(tmp_path, digits_h5):
    proc = mpirun(2, ["-m", "hpc_rlx", "-m", "optim.lr=-0.1,0.1", f"data.path={digits_h5}",
                      "train.epochs=1", "report.plots=false", "model.hidden=[16]"], timeout=180, cwd=tmp_path)
    assert proc.returncode == 2, explain(proc)
    assert "1 sweep point(s) failed: 0" in proc.stderr, explain(proc)
    assert proc.stderr.count("optim.lr must be a positive number") == 1, explain(proc)
    sweep = next((tmp_path / "multirun").iterdir())
    rows = {r["point"]: r for r in json.loads((sweep / "sweep_summary.json").read_text())}
    assert rows["0"]["status"] == "failed" and rows["1"]["status"] == "completed"


def test_an_added_key_in_a_sweep_is_refused(tmp_path, digits_h5):
    proc = mpirun(2, ["-m", "hpc_rlx", "-m", "+train.epochz=1,2", f"data.path={digits_h5}",
                      "train.epochs=1", "report.plots=false"], timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, explain(proc)
    assert "unknown config key(s) +train.epochz" in proc.stderr, explain(proc)
    sweep = next((tmp_path / "multirun").iterdir())
    assert not any((sweep / p / "metrics.jsonl").exists() for p in ("0", "1"))
