"""Memory that a step needs, bounded by keys: gradient accumulation (`train.accumulate`) and
validation in bounded batches (`train.eval_batch_size`), in real `mpirun` jobs."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.mpi.runtime.test_end_to_end import EQUIV, load_params, max_rel_diff
from tests.support.jobs import explain, read_metrics, train_job

pytestmark = pytest.mark.mpi


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _val_loss(run: Path) -> float:
    return read_metrics(run)[-1]["val_loss"]


def test_accumulated_micro_batches_train_like_one_big_batch(tmp_path, digits_h5):
    """float64, no dropout and no batch norm: K micro-batches per lane equal the step they
    split, with lanes and with comm.overlap (which overlaps the last micro-batch)."""
    base = EQUIV + [f"data.path={digits_h5}"]
    proc = train_job(1, tmp_path / "ref", base)
    assert proc.returncode == 0, explain(proc)
    ref = load_params(tmp_path / "ref")
    assert [r["eval_batch_rows"] for r in _summary(tmp_path / "ref")["ranks"]] == [24]
    variants = {
        # 12 rows a rank, 6 a lane, 4 micro-batches of 2,2,1,1: evaluated 3 rows at a time
        "lanes": (["train.accumulate=4", "device.cpu_lanes=2"], 3),
        "overlap": (["train.accumulate=3", "comm.overlap=true"], 4),
    }
    for name, (extra, eval_rows) in variants.items():
        run = tmp_path / name
        proc = train_job(2, run, base + extra)
        assert proc.returncode == 0, f"{name}: " + explain(proc)
        diff = max_rel_diff(ref, load_params(run))
        assert diff <= 1e-10, f"{name}: max relative parameter difference {diff:.3e}"
        assert [r["eval_batch_rows"] for r in _summary(run)["ranks"]] == [eval_rows] * 2, name
        assert _val_loss(run) == pytest.approx(_val_loss(tmp_path / "ref"), rel=1e-10)


def test_an_evaluation_batch_changes_only_the_rounding_and_not_between_caches(tmp_path, digits_h5):
    base = EQUIV + [f"data.path={digits_h5}"]
    runs = {"default": [], "memory7": ["train.eval_batch_size=7"],
            "stream7": ["train.eval_batch_size=7", "data.cache=stream"]}
    for name, extra in runs.items():
        proc = train_job(1, tmp_path / name, base + extra)
        assert proc.returncode == 0, f"{name}: " + explain(proc)
    assert [r["eval_batch_rows"] for r in _summary(tmp_path / "memory7")["ranks"]] == [7]
    ref = load_params(tmp_path / "default")
    for name in ("memory7", "stream7"):       # validation does not touch training
        got = load_params(tmp_path / name)
        assert all(np.array_equal(ref[k], got[k]) for k in ref), name
    per_epoch = {name: [m["val_loss"] for m in read_metrics(tmp_path / name)] for name in runs}
    assert per_epoch["memory7"] == per_epoch["stream7"]          # the same sums, in the same order
    for a, b in zip(per_epoch["default"], per_epoch["memory7"]):
        assert abs(a - b) <= 1e-12 * abs(a), (a, b)


@pytest.mark.slow
def test_validation_memory_stays_near_the_data_it_holds(tmp_path):
    """The case behind train.eval_batch_size: 50,000 uint8 images of 1x64x64 (196 MiB stored),
    a small CNN, 1,000 validation rows. Evaluated 1,024 rows at a time, the activations of one
    evaluation batch cost about 240 MiB more than the data; in training-sized batches they do not."""
    rng = np.random.default_rng(0)
    files = {}
    for name, rows in (("large", 50_000), ("small", 512)):
        files[name] = tmp_path / f"{name}.h5"
        with h5py.File(files[name], "w") as f:
            f["x"] = rng.integers(0, 256, (rows, 1, 64, 64), dtype=np.uint8)
            f["y"] = rng.integers(0, 10, rows).astype(np.int64)
    stored = 50_000 * 64 * 64
    peak = {}
    for name, path in files.items():
        run = tmp_path / name
        proc = train_job(1, run, ["data=file", f"data.path={path}", "model=cnn", "model.channels=[4]",
                                  "model.hidden=16", "train.batch_size=64", "train.max_steps=20",
                                  "data.val_fraction=0.02", "checkpoint=off"], timeout=300)
        assert proc.returncode == 0, f"{name}: " + explain(proc)
        (rank,) = _summary(run)["ranks"]
        assert rank["eval_batch_rows"] == 64
        peak[name] = rank["peak_rss_bytes"]
    assert peak["large"] - peak["small"] <= 1.3 * stored, (peak, stored)
