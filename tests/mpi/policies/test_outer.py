"""The outer optimizer's keys under real mpirun: `policy.reset_inner` (the inner optimizer
state is kept across syncs unless asked, as the DiLoCo paper's workers keep theirs) and
`policy.outer_warmup` (`bench/README.md` measures both)."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from hpc_rlx.checkpoint import checkpoint_name, checkpoints_dir, read_checkpoint

from tests.support.jobs import explain, train_job

pytestmark = pytest.mark.mpi


def _inner_state_after_three_syncs(run_dir, data, extra: list[str]) -> dict:
    # AdamW inside, DiLoCo outside, K fixed at 4; the checkpoint after the 3rd sync holds rank
    # 0's inner optimizer state as the next window starts from it
    proc = train_job(2, run_dir, [f"data.path={data}", "optim=adamw", "optim.lr=0.003",
                                  "policy=async", "policy.tune=false", "policy.anchor=4",
                                  "policy.outer=diloco", "train.batch_size=16", "train.epochs=1",
                                  "train.max_steps=3", "checkpoint.every_steps=3"] + extra,
                     timeout=180)
    assert proc.returncode == 0, explain(proc)
    state = read_checkpoint(checkpoints_dir(run_dir) / checkpoint_name(3))
    opt = {k: v for k, v in state.arrays.items() if k.startswith("opt/")}
    assert opt, sorted(state.arrays)
    return {"opt": opt, "params": state.arrays["params"]}


def test_inner_state_is_kept_across_syncs_unless_reset_inner(tmp_path, digits_h5):
    kept = _inner_state_after_three_syncs(tmp_path / "kept", digits_h5, [])
    reset = _inner_state_after_three_syncs(tmp_path / "reset", digits_h5, ["policy.reset_inner=true"])
    # kept: the AdamW moments of 12 local steps; reset: zeroed at the sync
    assert all(np.any(np.asarray(v) != 0) for v in kept["opt"].values()), \
        {k: float(np.abs(v).max()) for k, v in kept["opt"].items()}
    assert all(np.all(np.asarray(v) == 0) for v in reset["opt"].values()), \
        {k: float(np.abs(v).max()) for k, v in reset["opt"].items()}
    # and it changes the training: the windows after the first start from different moments
    assert not np.array_equal(kept["params"], reset["params"])


def test_outer_warmup_syncs_are_plain_averaging(tmp_path, digits_h5):
    # every sync of the run inside the warm-up: diloco's model equals outer=average's, bitwise
    base = [f"data.path={digits_h5}", "checkpoint=off", "policy=async", "policy.tune=false",
            "policy.anchor=8", "train.epochs=1", "optim=adamw", "optim.lr=0.003"]
    runs = {"average": base + ["policy.outer=average"],
            "warm": base + ["policy.outer=diloco", "policy.outer_warmup=1000"]}
    params = {}
    for name, overrides in runs.items():
        proc = train_job(2, tmp_path / name, overrides, timeout=180)
        assert proc.returncode == 0, explain(proc)
        with h5py.File(tmp_path / name / "model.h5", "r") as f:
            params[name] = {k: f[k][...] for k in f.keys()}
    assert params["warm"].keys() == params["average"].keys()
    for k in params["average"]:
        assert np.array_equal(params["warm"][k], params["average"][k]), k
