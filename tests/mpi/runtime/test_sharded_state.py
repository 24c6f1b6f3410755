"""`comm.shard=optimizer` (ZeRO-1 over MPI) in real `mpirun` jobs, float64: sharded and whole
optimizer state train the same model, checkpoints move between the two and across world
sizes, and each rank reports the state it holds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.mpi.runtime.test_end_to_end import load_params, max_rel_diff
from tests.support.jobs import explain, read_metrics, train_job

pytestmark = pytest.mark.mpi

BASE = ["train.dtype=float64", "train.epochs=2", "train.batch_size=24", "data.leftover=partial",
        "model.hidden=[32,16]", "optim.lr=0.05"]
ADAMW = ["optim=adamw", "optim.lr=0.003"]


def _ranks(run: Path) -> list[dict]:
    return json.loads((run / "summary.json").read_text())["ranks"]


def _pair(tmp_path: Path, ranks: int, overrides: list[str], name: str) -> tuple[Path, Path]:
    """The same job with whole and with sharded optimizer state."""
    runs = []
    for shard in ("none", "optimizer"):
        run = tmp_path / f"{name}-{shard}"
        proc = train_job(ranks, run, overrides + ["checkpoint=off", f"comm.shard={shard}"], timeout=240)
        assert proc.returncode == 0, f"{name}, comm.shard={shard}: " + explain(proc)
        runs.append(run)
    return runs[0], runs[1]


@pytest.mark.parametrize("ranks, extra", [
    (2, ["optim.momentum=0.9"]),                                   # SGD with momentum
    (4, ADAMW),
    (2, ADAMW + ["optim.clip_grad_norm=0.5", "device.cpu_lanes=2"]),   # the global norm from the slices
], ids=["sgd-momentum-2", "adamw-4", "adamw-clip-lanes-2"])
def test_sharded_state_trains_the_same_model_and_holds_a_slice(tmp_path, digits_h5, ranks, extra):
    whole, sharded = _pair(tmp_path, ranks, BASE + [f"data.path={digits_h5}"] + extra, "job")
    diff = max_rel_diff(load_params(whole), load_params(sharded))
    assert diff <= 1e-10, f"max relative parameter difference {diff:.3e}"
    full, parts = _ranks(whole), _ranks(sharded)
    # every rank holds all the parameters, and 1/N of the optimizer state (its slices cover it once)
    assert [r["param_bytes"] for r in parts] == [r["param_bytes"] for r in full]
    assert sum(r["optimizer_bytes"] for r in parts) == full[0]["optimizer_bytes"]
    assert max(r["optimizer_bytes"] for r in parts) <= full[0]["optimizer_bytes"] / ranks + 8 * 4, parts
    assert "reduce-scatter (comm.shard=optimizer)" in (sharded / "hpc_rlx.log").read_text()


def test_sharded_state_with_the_16_bit_wire(tmp_path, digits_h5):
    """The reduce-scatter carries bfloat16 words, summed in float32 by each slice's owner: the
    run trains as the unsharded run on the same wire does, within the wire's rounding."""
    overrides = BASE + [f"data.path={digits_h5}", "comm.wire_dtype=bfloat16"] + ADAMW
    whole, sharded = _pair(tmp_path, 2, overrides, "wire")
    assert "wire bfloat16" in (sharded / "hpc_rlx.log").read_text()
    losses = [read_metrics(run)[-1]["val_loss"] for run in (whole, sharded)]
    assert losses[1] == pytest.approx(losses[0], rel=0.02), losses
    assert max_rel_diff(load_params(whole), load_params(sharded)) <= 0.05


def test_deterministic_sharded_runs_repeat_bitwise(tmp_path, digits_h5):
    """Under comm.deterministic the reduce-scatter adds every rank's slice in rank order (as the
    ordered Allreduce does) and the clipping norm sums the slices' shares in rank order: two
    sharded runs are bitwise equal."""
    overrides = BASE + [f"data.path={digits_h5}", "comm.deterministic=true", "optim.clip_grad_norm=0.5",
                        "checkpoint=off", "comm.shard=optimizer"] + ADAMW
    runs = [tmp_path / "first", tmp_path / "again"]
    for run in runs:
        proc = train_job(2, run, overrides, timeout=240)
        assert proc.returncode == 0, explain(proc)
    a, b = (load_params(run) for run in runs)
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k}: max abs difference {np.abs(a[k] - b[k]).max():.3e}"


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, digits_h5) -> Path:
    """The uninterrupted unsharded run the resumed ones are compared with."""
    run = tmp_path_factory.mktemp("shard_ref") / "run"
    proc = train_job(2, run, BASE + [f"data.path={digits_h5}", "checkpoint=off"] + ADAMW, timeout=240)
    assert proc.returncode == 0, explain(proc)
    return run


@pytest.mark.parametrize("first, then", [((4, "optimizer"), (2, "none")), ((2, "none"), (4, "optimizer"))],
                         ids=["sharded-4-then-whole-2", "whole-2-then-sharded-4"])
def test_a_checkpoint_resumes_with_sharding_switched_and_another_world_size(tmp_path, digits_h5, straight_run,
                                                                          first, then):
    base = BASE + [f"data.path={digits_h5}"] + ADAMW
    run = tmp_path / "run"
    # stop in the middle of the second epoch (1438 rows, 24 a step: 60 steps an epoch)
    proc = train_job(first[0], run, base + [f"comm.shard={first[1]}", "train.max_steps=75"], timeout=240)
    assert proc.returncode == 0, explain(proc)
    proc = train_job(then[0], run, base + [f"comm.shard={then[1]}"], timeout=240)
    assert proc.returncode == 0, explain(proc)
    assert f"written on {first[0]} ranks, shards re-planned for {then[0]}" in proc.stdout, explain(proc)
    diff = max_rel_diff(load_params(straight_run), load_params(run))
    assert diff <= 1e-10, f"max relative parameter difference {diff:.3e} from the straight run"
