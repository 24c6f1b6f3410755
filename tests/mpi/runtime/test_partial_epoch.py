"""`train.max_steps` ending a run mid-epoch still records the epoch's metrics (marked partial)."""

from __future__ import annotations

import json

import pytest

from hpc_rlx.report import text as report

from tests.support.jobs import explain, read_metrics, train_job

pytestmark = pytest.mark.mpi


def _epoch_records(run_dir):
    return [m for m in read_metrics(run_dir) if "epoch" in m]


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
def test_max_steps_mid_epoch_writes_a_partial_record_and_final_metrics(tmp_path, digits_h5, policy):
    run_dir = tmp_path / "run"
    # windowed policies: at most 2 x 4 local steps of 32 samples per sync, so 3 syncs stay
    # inside the 1408-sample epoch whatever the measured speeds (cadence in lockstep: a rank
    # measured faster under load would otherwise run more steps than the anchor)
    small = [] if policy == "sync" else ["policy.anchor=2", "policy.max_anchor=4"]
    small += ["policy.max_batch_diff=0"] if policy == "cadence" else []
    proc = train_job(2, run_dir, [f"data.path={digits_h5}", f"policy={policy}", "train.max_steps=3"] + small)
    assert proc.returncode == 0, explain(proc)
    recs = _epoch_records(run_dir)
    assert recs, "metrics.jsonl has no epoch record"
    last = recs[-1]
    assert last["partial"] is True and last["step"] == 3
    assert 0 < last["epoch_fraction"] < 1
    assert last["policy"] == policy
    assert isinstance(last["val_loss"], float) and isinstance(last["train_loss"], float)
    assert all(not r.get("partial") for r in recs[:-1])       # earlier epochs were complete
    final = json.loads((run_dir / "summary.json").read_text())["final"]
    assert final["step"] == 3 and final["val_loss"] == pytest.approx(last["val_loss"])
    text = report.run_text(report.load_run(run_dir))
    assert f"policy {policy}" in text and "val_loss -" not in text


def test_resume_after_a_partial_epoch_records_the_whole_epoch_once(tmp_path, digits_h5):
    run_dir = tmp_path / "run"
    common = [f"data.path={digits_h5}", "train.epochs=2"]
    proc = train_job(2, run_dir, common + ["train.max_steps=5"])
    assert proc.returncode == 0, explain(proc)
    assert [r.get("partial") for r in _epoch_records(run_dir)] == [True]
    proc = train_job(2, run_dir, common)
    assert proc.returncode == 0, explain(proc)
    recs = _epoch_records(run_dir)
    assert [r["epoch"] for r in recs] == [1, 2] and not any(r.get("partial") for r in recs)
    assert recs[0]["steps"] == recs[1]["steps"]        # epoch 1 counts the steps of both segments


def test_windowed_stop_exactly_at_the_epoch_end_records_a_complete_epoch(tmp_path, digits_h5):
    # async with a fixed K=11 on 2 ranks: 2 syncs x 2 ranks x 11 steps x 32 samples = the epoch
    run_dir = tmp_path / "run"
    common = [f"data.path={digits_h5}", "train.epochs=2", "policy=async", "policy.anchor=11",
              "policy.max_anchor=11", "policy.divergence_threshold=null"]
    proc = train_job(2, run_dir, common + ["train.max_steps=2"])
    assert proc.returncode == 0, explain(proc)
    recs = _epoch_records(run_dir)
    assert [(r["epoch"], r.get("partial", False), r["syncs"]) for r in recs] == [(1, False, 2)]
    proc = train_job(2, run_dir, common)
    assert proc.returncode == 0, explain(proc)
    recs = _epoch_records(run_dir)
    assert [(r["epoch"], r["syncs"]) for r in recs] == [(1, 2), (2, 2)]
