"""Pipeline stages keep the reliability features: ``train.on_nonfinite=skip`` skips a step on
every rank of every stage as one rank skips it (float64: the same model within 1e-10, the same
count of skipped steps). Real 2-rank S=2 jobs under mpirun."""

from __future__ import annotations

import json

import pytest

from .conftest import explain, read_metrics, train_job
from .test_pipeline_run import BASE, assert_same_training

pytestmark = pytest.mark.mpi

SKIP = ["train.on_nonfinite=skip", "debug.nan_step=4"]


@pytest.mark.parametrize("nan_rank", [0, 1], ids=["stage0", "stage1"])
def test_nonfinite_skip_skips_the_step_on_every_stage_like_one_rank(tmp_path, digits_h5, nan_rank):
    ref, run = tmp_path / "ref", tmp_path / "pipe"
    proc = train_job(1, ref, BASE + [f"data.path={digits_h5}", "debug.nan_rank=0"] + SKIP, timeout=120)
    assert proc.returncode == 0, explain(proc)
    proc = train_job(2, run, BASE + [f"data.path={digits_h5}", "parallel.pipeline_stages=2",
                                     f"debug.nan_rank={nan_rank}"] + SKIP, timeout=120)
    assert proc.returncode == 0, explain(proc)
    assert [m["skipped_steps"] for m in read_metrics(run)] == [m["skipped_steps"] for m in read_metrics(ref)]
    assert read_metrics(run)[0]["skipped_steps"] == 1
    a = json.loads((ref / "summary.json").read_text())
    b = json.loads((run / "summary.json").read_text())
    assert (b["skipped_steps"], b["steps"]) == (a["skipped_steps"], a["steps"]) == (1, a["steps"])
    assert_same_training(ref, run)    # the skipped step moved no stage's parameters
