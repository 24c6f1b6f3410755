"""`comm.shard=optimizer` (ZeRO-1 over MPI) in real `mpirun` jobs, float64: sharded and whole
optimizer state train the same model, checkpoints move between the two and across world
sizes, and each rank reports the state it holds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.mpi.runtime.test_end_to_end import load_params, max_rel_diff
from tests.support.jobs import explain, train_job

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


def test_deterministic_sharded_runs_repeat_bitwise(tmp_path, digits_h5):
    """Under comm.deterministic the reduce-scatter adds every rank's slice in rank order, as the
    ordered Allreduce does: two sharded runs are bitwise equal, and equal the unsharded one to
    the last bits (the optimizer's vector kernels may round a slice's first and last elements
    differently from the same elements in the middle of the whole array)."""
    overrides = BASE + [f"data.path={digits_h5}", "comm.deterministic=true"] + ADAMW
    whole, sharded = _pair(tmp_path, 2, overrides, "ordered")
    again = tmp_path / "again"
    proc = train_job(2, again, overrides + ["checkpoint=off", "comm.shard=optimizer"], timeout=240)
    assert proc.returncode == 0, explain(proc)
    a, b = load_params(sharded), load_params(again)
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k}: max abs difference {np.abs(a[k] - b[k]).max():.3e}"
    diff = max_rel_diff(load_params(whole), a)
    assert diff <= 1e-13, f"max relative parameter difference {diff:.3e}"


@pytest.mark.parametrize("first, then", [((4, "optimizer"), (2, "none")), ((2, "none"), (4, "optimizer"))],
                         ids=["sharded-4-then-whole-2", "whole-2-then-sharded-4"])
def test_a_checkpoint_resumes_with_sharding_switched_and_another_world_size(tmp_path, digits_h5, first, then):
    base = BASE + [f"data.path={digits_h5}"] + ADAMW
    ref = tmp_path / "ref"
    proc = train_job(2, ref, base + ["checkpoint=off"], timeout=240)
    assert proc.returncode == 0, explain(proc)
    run = tmp_path / "run"
    # stop in the middle of the second epoch (1438 rows, 24 a step: 60 steps an epoch)
    proc = train_job(first[0], run, base + [f"comm.shard={first[1]}", "train.max_steps=75"], timeout=240)
    assert proc.returncode == 0, explain(proc)
    proc = train_job(then[0], run, base + [f"comm.shard={then[1]}"], timeout=240)
    assert proc.returncode == 0, explain(proc)
    assert f"written on {first[0]} ranks, shards re-planned for {then[0]}" in proc.stdout, explain(proc)
    diff = max_rel_diff(load_params(ref), load_params(run))
    assert diff <= 1e-10, f"max relative parameter difference {diff:.3e} from the straight run"
