"""`python -m hpc_rlx parallel.pipeline_stages=S` under real mpirun: a pipelined job trains like
one rank with the same global batch (float64, policy sync: model.h5 and every epoch's losses
within 1e-10), GPipe and 1F1B, MLP, CNN and transformer LM, S x D = 2x1, 2x2, 4x2 (8 ranks,
oversubscribed); its config errors fail the same way on every rank; a non-finite gradient on
any stage stops every rank in the same step."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.support.jobs import explain, read_metrics, train_job

# the module's fixture runs its jobs once: its tests keep to one pytest-xdist worker
pytestmark = [pytest.mark.mpi, pytest.mark.xdist_group("pipeline-reference")]

BASE = ["train.dtype=float64", "train.epochs=2", "train.batch_size=24", "data.leftover=partial",
        "model.hidden=[32,16]", "optim.lr=0.05", "checkpoint=off"]
CNN = ["model=cnn", "model.channels=[4,6]", "model.hidden=12", "train.dtype=float64", "train.epochs=1",
       "train.batch_size=32", "checkpoint=off", "train.max_steps=12"]


def params(run_dir: Path) -> dict:
    with h5py.File(run_dir / "model.h5", "r") as f:
        return {k: f[k][...] for k in f.keys()}


def assert_same_training(ref_dir: Path, run_dir: Path) -> None:
    a, b = params(ref_dir), params(run_dir)
    assert a.keys() == b.keys()
    floor = 1e-3 * max(float(np.abs(v).max()) for v in a.values())   # attention's key bias stays ~0
    for k in a:
        rel = float(np.abs(a[k] - b[k]).max()) / max(float(np.abs(a[k]).max()), floor)
        assert rel <= 1e-10, (k, rel)
    ma, mb = read_metrics(ref_dir), read_metrics(run_dir)
    assert len(ma) == len(mb)
    for ra, rb in zip(ma, mb):
        for key in ("train_loss", "val_loss", "val_accuracy"):
            if ra.get(key) is not None:
                assert abs(ra[key] - rb[key]) <= 1e-10 * max(abs(ra[key]), 1e-300), (key, ra, rb)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, digits_h5):
    """One rank, no pipeline: the runs below must end where these end."""
    root = tmp_path_factory.mktemp("pipe_ref")
    runs = {}
    for name, overrides in (("mlp", BASE), ("cnn", CNN)):
        proc = train_job(1, root / name, overrides + [f"data.path={digits_h5}"])
        assert proc.returncode == 0, explain(proc)
        runs[name] = root / name
    return runs


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_train_like_one_rank(tmp_path, digits_h5, reference, schedule):
    run = tmp_path / schedule
    proc = train_job(2, run, BASE + [f"data.path={digits_h5}", "parallel.pipeline_stages=2",
                                     "parallel.microbatches=4", f"parallel.schedule={schedule}"])
    assert proc.returncode == 0, explain(proc)
    assert "pipeline stage 1 of 2" in proc.stdout + proc.stderr
    assert_same_training(reference["mlp"], run)


def test_cnn_two_stages(tmp_path, digits_h5, reference):
    proc = train_job(2, tmp_path / "cnn", CNN + [f"data.path={digits_h5}", "parallel.pipeline_stages=2"])
    assert proc.returncode == 0, explain(proc)
    assert_same_training(reference["cnn"], tmp_path / "cnn")


def test_transformer_lm_two_stages(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 11, (200, 9))
    with h5py.File(tmp_path / "tok.h5", "w") as f:
        f["x"], f["y"] = tokens[:, :8], tokens[:, 1:]
        f.attrs["num_classes"] = 11
    lm = ["model=transformer_lm", "data=file", f"data.path={tmp_path / 'tok.h5'}", "model.d_model=16",
          "model.n_heads=2", "model.d_ff=32", "train.epochs=2", "train.batch_size=16",
          "train.dtype=float64", "checkpoint=off"]
    proc = train_job(1, tmp_path / "one", lm)
    assert proc.returncode == 0, explain(proc)
    proc = train_job(2, tmp_path / "two", lm + ["parallel.pipeline_stages=2", "parallel.schedule=gpipe"])
    assert proc.returncode == 0, explain(proc)
    assert_same_training(tmp_path / "one", tmp_path / "two")


@pytest.mark.parametrize("data", [
    [],
    pytest.param(["data.cache=stream", "data.distribution=scatter"], marks=pytest.mark.slow),
])
def test_two_stages_two_replicas(tmp_path, digits_h5, reference, data):
    # 24 rows over 2 replicas, 4 micro-batches of 3; each stage's replicas load (or stream) their shards
    proc = train_job(4, tmp_path / "s2d2", BASE + data + [f"data.path={digits_h5}", "parallel.pipeline_stages=2"])
    assert proc.returncode == 0, explain(proc)
    assert_same_training(reference["mlp"], tmp_path / "s2d2")


def test_four_stages_two_replicas_on_eight_ranks(tmp_path, digits_h5, reference):
    proc = train_job(8, tmp_path / "s4d2", BASE + [f"data.path={digits_h5}", "parallel.pipeline_stages=4",
                                                   "parallel.microbatches=3"], timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert_same_training(reference["mlp"], tmp_path / "s4d2")


@pytest.mark.parametrize("nan_rank", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_a_nan_on_either_stage_stops_every_rank_in_that_step(tmp_path, digits_h5, nan_rank):
    run = tmp_path / "nan"
    proc = train_job(2, run, BASE + [f"data.path={digits_h5}", "parallel.pipeline_stages=2",
                                     f"debug.nan_rank={nan_rank}", "debug.nan_step=3"], timeout=120)
    assert proc.returncode != 0, explain(proc)
    assert "non-finite loss or gradient at step 3" in proc.stderr, explain(proc)
    assert proc.stderr.count("hpc_rlx: error") == 1, explain(proc)


@pytest.mark.parametrize("n,overrides,fragment", [
    (3, ["parallel.pipeline_stages=2"], "parallel.pipeline_stages=2 does not divide the 3 ranks"),
    (2, ["parallel.pipeline_stages=2", "parallel.microbatches=0"], "parallel.microbatches must be a positive integer"),
    (2, ["parallel.pipeline_stages=2", "parallel.cut_points=[nope]"], "cut point 'nope' is not a node"),
    pytest.param(2, ["parallel.pipeline_stages=2", "parallel.cut_points=[xent]"], "outside the last stage",
                 marks=pytest.mark.slow),
    (2, ["parallel.pipeline_stages=2", "policy=cadence"], "runs with policy=sync only; policy=cadence"),
    pytest.param(2, ["parallel.pipeline_stages=2", "policy=async"], "runs with policy=sync only; policy=async",
                 marks=pytest.mark.slow),
    pytest.param(2, ["parallel.schedule=zigzag"], "parallel.schedule='zigzag' is not one of",
                 marks=pytest.mark.slow),
])
def test_pipeline_config_errors_fail_cleanly_on_every_rank(tmp_path, digits_h5, n, overrides, fragment):
    run = tmp_path / "run"
    proc = train_job(n, run, [f"data.path={digits_h5}", "checkpoint=off"] + overrides, timeout=60)
    assert proc.returncode != 0
    assert fragment in proc.stderr, explain(proc)
    assert proc.stderr.count("hpc_rlx: error") == 1, explain(proc)
    assert not (run / "metrics.jsonl").exists()


def test_each_stage_holds_its_share_and_traces_its_micro_batches(tmp_path, digits_h5):
    import json
    run = tmp_path / "mem"
    proc = train_job(2, run, [f"data.path={digits_h5}", "checkpoint=off", "train.epochs=1", "train.max_steps=5",
                              "model.hidden=[64,64,64,64]", "optim=adamw", "trace.enabled=true",
                              "parallel.pipeline_stages=2", "parallel.microbatches=3",
                              "parallel.balance=params"])    # the memory split (time would move it)
    assert proc.returncode == 0, explain(proc)
    ranks = json.loads((run / "summary.json").read_text())["ranks"]
    whole = (64 * 64 + 64) * 4 + 64 * 10 + 10              # parameters of the whole model
    assert sum(r["param_bytes"] for r in ranks) == whole * 4  # float32
    for r in ranks:                                          # balanced: each about half
        assert abs(r["param_bytes"] - whole * 4 / 2) <= 0.2 * whole * 4 / 2, r
        # AdamW: two moments and one scratch per parameter
        assert abs(r["optimizer_bytes"] - 3 * r["param_bytes"]) <= 0.01 * r["param_bytes"], r
    events = json.loads((run / "trace.json").read_text())["traceEvents"]
    for stage in (0, 1):
        fwd = [e for e in events if e.get("name") == "forward" and e.get("ph") == "X"
               and e.get("args", {}).get("micro") is not None and e.get("pid") == stage]
        assert sorted({e["args"]["micro"] for e in fwd}) == [0, 1, 2], stage
    names = {e.get("name") for e in events}
    assert {"recv activations", "recv gradients", "backward", "flags allreduce"} <= names
