"""End-to-end runtime under real mpirun: accuracy, equivalence across ranks/lanes, read vs scatter,
outputs, and startup errors that must fail the same way on every rank without hanging."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.support.jobs import explain, read_metrics, train_job

pytestmark = pytest.mark.mpi


def load_params(run_dir: Path) -> dict:
    with h5py.File(run_dir / "model.h5", "r") as f:
        return {k: f[k][...] for k in f.keys()}


def max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        denom = max(np.abs(a[k]).max(), 1e-300)
        worst = max(worst, float(np.abs(a[k] - b[k]).max() / denom))
    return worst


def test_default_job_reaches_95_percent_on_digits(tmp_path, digits_h5):
    run = tmp_path / "run"
    proc = train_job(4, run, [f"data.path={digits_h5}"], timeout=240)
    assert proc.returncode == 0, explain(proc)
    metrics = read_metrics(run)
    assert len(metrics) == 20
    for key in ("epoch", "train_loss", "val_loss", "val_accuracy", "lr", "samples_per_s", "compute_s", "comm_s"):
        assert key in metrics[-1]
    assert metrics[-1]["val_accuracy"] >= 0.95, metrics[-1]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 4 and len(summary["ranks"]) == 4
    for r in summary["ranks"]:
        for key in ("lanes", "inventory", "samples", "wall_s", "compute_s", "comm_s", "first_loss", "last_loss"):
            assert key in r
        assert r["last_loss"] < r["first_loss"]
    assert (run / "config.yaml").exists() and (run / "model.h5").exists()
    # Only rank 0 writes: no per-rank Hydra folders or logs.
    assert not (run / ".hydra").exists()


EQUIV = ["train.dtype=float64", "train.epochs=2", "train.batch_size=24", "data.leftover=partial",
         "model.hidden=[32,16]", "optim.lr=0.05", "checkpoint=off"]


@pytest.mark.slow
def test_float64_sync_is_equivalent_across_ranks_and_lanes(tmp_path, digits_h5):
    base = EQUIV + [f"data.path={digits_h5}"]
    ref_dir = tmp_path / "w1"
    proc = train_job(1, ref_dir, base)
    assert proc.returncode == 0, explain(proc)
    ref = load_params(ref_dir)
    variants = {
        "w2": (2, []),
        "w4": (4, []),                       # 24 rows over 4 ranks
        "w1_lanes2": (1, ["device.cpu_lanes=2"]),
        "w2_lanes3": (2, ["device.cpu_lanes=3"]),   # uneven lane splits
        "w3": (3, ["data.distribution=scatter"]),  # uneven rows per rank? 24/3 even; scatter path
    }
    for name, (n, extra) in variants.items():
        d = tmp_path / name
        proc = train_job(n, d, base + extra)
        assert proc.returncode == 0, f"{name}: " + explain(proc)
        diff = max_rel_diff(ref, load_params(d))
        assert diff <= 1e-10, f"{name}: max relative parameter difference {diff:.3e}"


@pytest.mark.openmpi
def test_uneven_rows_per_rank_match_one_rank(tmp_path, digits_h5):
    base = EQUIV + [f"data.path={digits_h5}", "train.batch_size=10", "train.epochs=1"]
    proc = train_job(1, tmp_path / "a", base)
    assert proc.returncode == 0, explain(proc)
    proc = train_job(4, tmp_path / "b", base)       # 10 rows over 4 ranks: 3,3,2,2
    assert proc.returncode == 0, explain(proc)
    assert max_rel_diff(load_params(tmp_path / "a"), load_params(tmp_path / "b")) <= 1e-10


@pytest.mark.openmpi
def test_read_and_scatter_give_identical_training(tmp_path, digits_h5):
    base = [f"data.path={digits_h5}", "train.epochs=2", "checkpoint=off"]
    proc = train_job(2, tmp_path / "read", base + ["data.distribution=read"])
    assert proc.returncode == 0, explain(proc)
    proc = train_job(2, tmp_path / "scatter", base + ["data.distribution=scatter"])
    assert proc.returncode == 0, explain(proc)
    a, b = load_params(tmp_path / "read"), load_params(tmp_path / "scatter")
    for k in a:
        assert np.array_equal(a[k], b[k]), k


@pytest.mark.parametrize("n,overrides,fragment", [
    pytest.param(2, ["train.batch_size=5000"], "larger than the training set", marks=pytest.mark.openmpi),
    pytest.param(4, ["train.batch_size=3"], "smaller than the number of ranks", marks=pytest.mark.openmpi),
    (2, ["train.batch_size=0"], "train.batch_size must be a positive integer"),
    (2, ["optim.lr=-0.1"], "optim.lr must be a positive number"),
])
def test_startup_errors_fail_cleanly_on_every_rank(tmp_path, digits_h5, n, overrides, fragment):
    run = tmp_path / "run"
    proc = train_job(n, run, [f"data.path={digits_h5}"] + overrides, timeout=60)
    assert proc.returncode != 0
    assert fragment in proc.stderr, explain(proc)
    assert proc.stderr.count("hpc_rlx: error") == 1, explain(proc)
    assert not (run / "metrics.jsonl").exists()


def test_more_ranks_than_samples_is_refused(tmp_path):
    tiny = tmp_path / "tiny.h5"
    with h5py.File(tiny, "w") as f:
        f["x"] = np.random.default_rng(0).random((3, 4)).astype(np.float32)
        f["y"] = np.array([0, 1, 0], dtype=np.int64)
        f.attrs["num_classes"] = 2
    proc = train_job(4, tmp_path / "run", ["data=file", f"data.path={tiny}", "data.val_fraction=0",
                                           "train.batch_size=4"], timeout=60)
    assert proc.returncode != 0
    assert "more ranks (4) than training samples (3)" in proc.stderr, explain(proc)


@pytest.mark.slow
def test_eight_ranks_oversubscribed_complete(tmp_path, digits_h5):
    run = tmp_path / "run"
    proc = train_job(8, run, [f"data.path={digits_h5}", "train.epochs=2"], timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert len(read_metrics(run)) == 2


def test_a_graph_json_file_trains_like_the_builtin_model(tmp_path, digits_h5):
    """model=graph: a graph exported by one run (graph.json) trains the same in another."""
    base = [f"data.path={digits_h5}", "train.epochs=2", "checkpoint=off", "train.dtype=float64"]
    proc = train_job(2, tmp_path / "builtin", base + ["model.hidden=[32]"])
    assert proc.returncode == 0, explain(proc)
    graph_file = tmp_path / "my_graph.json"
    graph_file.write_text((tmp_path / "builtin" / "graph.json").read_text())
    proc = train_job(2, tmp_path / "file", base + ["model=graph", f"model.path={graph_file}"])
    assert proc.returncode == 0, explain(proc)
    a, b = load_params(tmp_path / "builtin"), load_params(tmp_path / "file")
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_init_from_starts_from_a_previous_model(tmp_path, digits_h5):
    base = [f"data.path={digits_h5}", "checkpoint=off", "model.hidden=[32]"]
    proc = train_job(2, tmp_path / "first", base + ["train.epochs=3"])
    assert proc.returncode == 0, explain(proc)
    first = read_metrics(tmp_path / "first")
    proc = train_job(2, tmp_path / "second", base + ["train.epochs=1",
                                                     f"model.init_from={tmp_path / 'first' / 'model.h5'}"])
    assert proc.returncode == 0, explain(proc)
    second = read_metrics(tmp_path / "second")
    # a fresh model's first epoch is far worse than one that starts from 3 trained epochs
    fresh = first[0]["train_loss"]
    assert second[0]["train_loss"] < 0.5 * fresh, (second[0], first[0])
    proc = train_job(2, tmp_path / "bad", base + ["train.epochs=1", "model.hidden=[16]",
                                                  f"model.init_from={tmp_path / 'first' / 'model.h5'}"])
    assert proc.returncode == 2 and "model.init_from" in proc.stderr and "shape" in proc.stderr, explain(proc)


def test_deterministic_mode_is_bitwise_with_several_lanes(tmp_path, digits_h5):
    base = [f"data.path={digits_h5}", "train.epochs=2", "checkpoint=off", "model.hidden=[32]",
            "comm.deterministic=true", "device.cpu_lanes=2"]
    for name in ("a", "b"):
        proc = train_job(2, tmp_path / name, base)
        assert proc.returncode == 0, explain(proc)
    a, b = load_params(tmp_path / "a"), load_params(tmp_path / "b")
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_lion_trains_the_default_job(tmp_path, digits_h5):
    """optim=lion, declared in one file and one YAML, from the command line to a trained model."""
    run = tmp_path / "run"
    proc = train_job(2, run, [f"data.path={digits_h5}", "optim=lion", "optim.lr=0.003", "train.epochs=3", "checkpoint=off"])
    assert proc.returncode == 0, explain(proc)
    metrics = read_metrics(run)
    assert metrics[-1]["train_loss"] < 0.5 * metrics[0]["train_loss"], metrics
    assert metrics[-1]["val_accuracy"] >= 0.9, metrics[-1]
    summary = json.loads((run / "summary.json").read_text())
    for r in summary["ranks"]:           # momentum and scratch: two parameter-sized arrays
        assert r["optimizer_bytes"] == 2 * r["param_bytes"], r
