"""Lanes inside a pipeline stage (`device.cpu_lanes=N` with `parallel.pipeline_stages` > 1):
each micro-batch's rows split over the stage's CPU lanes, their gradients summed into the
stage's bucket; in float64 a run ends within 1e-10 of the same run with one lane per stage."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from tests.support.jobs import explain, train_job
from tests.mpi.pipeline.test_run import BASE, assert_same_training

pytestmark = pytest.mark.mpi


def test_two_lanes_per_stage_train_like_one(tmp_path, digits_h5):
    pipe = BASE + [f"data.path={digits_h5}", "parallel.pipeline_stages=2", "parallel.microbatches=4"]
    proc = train_job(2, tmp_path / "one", pipe)
    assert proc.returncode == 0, explain(proc)
    proc = train_job(2, tmp_path / "two", pipe + ["device.cpu_lanes=2"])
    assert proc.returncode == 0, explain(proc)
    assert "2 CPU lanes splitting each micro-batch" in proc.stdout + proc.stderr, explain(proc)
    assert_same_training(tmp_path / "one", tmp_path / "two")


def test_three_lanes_on_uneven_micro_batches_of_the_lm(tmp_path):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 11, (120, 9))
    with h5py.File(tmp_path / "tok.h5", "w") as f:
        f["x"], f["y"] = tokens[:, :8], tokens[:, 1:]
        f.attrs["num_classes"] = 11
    # 16 rows, 4 micro-batches of 4, over 3 lanes: 2 + 1 + 1 rows
    lm = ["model=transformer_lm", "data=file", f"data.path={tmp_path / 'tok.h5'}", "model.d_model=16",
          "model.n_heads=2", "model.d_ff=32", "train.epochs=1", "train.batch_size=16", "train.max_steps=5",
          "train.dtype=float64", "checkpoint=off", "parallel.pipeline_stages=2", "parallel.schedule=gpipe"]
    proc = train_job(2, tmp_path / "one", lm)
    assert proc.returncode == 0, explain(proc)
    proc = train_job(2, tmp_path / "three", lm + ["device.cpu_lanes=3"])
    assert proc.returncode == 0, explain(proc)
    assert_same_training(tmp_path / "one", tmp_path / "three")
