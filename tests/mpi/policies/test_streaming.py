"""Streaming outer syncs and the coded outer wire under real mpirun (`policy.fragments`,
`policy.fragment_delay`, `policy.outer_wire_dtype`), float64: DiLoCo unchanged by the neutral
settings, each fragment applied on its schedule after its delay, a resume between fragment syncs
(a fragment in flight, residuals, every rank's inner state) bitwise exact, and the coded wire's
bytes and determinism."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from hpc_rlx.checkpoint import checkpoint_name, checkpoints_dir, read_checkpoint
from hpc_rlx.policies.fragments import fragment_bounds

from tests.support.jobs import explain, read_metrics, train_job

pytestmark = pytest.mark.mpi

DILOCO = ["policy=async", "policy.tune=false", "policy.outer=diloco", "policy.outer_warmup=2",
          "train.dtype=float64", "optim=adamw", "optim.lr=0.003"]


def _model(run_dir) -> dict:
    with h5py.File(run_dir / "model.h5", "r") as f:
        return {k: f[k][...] for k in f.keys()}


def _train(run_dir, data, extra: list[str], timeout: float = 240):
    proc = train_job(2, run_dir, [f"data.path={data}"] + DILOCO + extra, timeout=timeout)
    assert proc.returncode == 0, explain(proc)
    return proc


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_one_fragment_without_delay_and_an_uncoded_wire_is_diloco_bitwise(tmp_path, digits_h5):
    base = ["checkpoint=off", "policy.anchor=8", "train.epochs=2"]
    _train(tmp_path / "diloco", digits_h5, base)
    _train(tmp_path / "neutral", digits_h5, base + ["policy.fragments=1", "policy.fragment_delay=0",
                                                     "policy.outer_wire_dtype=null"])
    _train(tmp_path / "two", digits_h5, base + ["policy.fragments=2"])
    assert _same(_model(tmp_path / "neutral"), _model(tmp_path / "diloco"))
    # and the streaming path does change the training (the comparison can fail)
    assert not _same(_model(tmp_path / "two"), _model(tmp_path / "diloco"))


def test_each_fragment_is_applied_on_its_schedule_after_its_delay(tmp_path, digits_h5):
    # K=4, F=2: sub-windows of 2 steps, fragment j mod 2 sent at the end of sub-window j and,
    # with tau=2, applied after the 2 steps of the next one, right before the next send. With
    # mix 0 the rank then takes the global fragment as it is. So at every checkpoint (taken
    # after a send) the fragment applied last is identical on both ranks and equal to the
    # agreed model, and the fragment just sent is not.
    run = tmp_path / "run"
    _train(run, digits_h5, ["policy.anchor=4", "policy.fragments=2", "policy.fragment_delay=2",
                            "policy.fragment_mix=0", "policy.outer=average", "policy.outer_warmup=null",
                            "train.epochs=1", "train.max_steps=6", "checkpoint.every_steps=1",
                            "checkpoint.keep_last=10"])
    seen = []
    for step in range(2, 6):
        state = read_checkpoint(checkpoints_dir(run) / checkpoint_name(step))
        meta = state.meta["policy"]["state"]["streaming"]
        agreed, mine, theirs = (state.arrays["policy/global"], state.arrays["ranks/0/params"],
                                state.arrays["ranks/1/params"])
        bounds = fragment_bounds(agreed.size, 2)
        in_flight = meta["in_flight"]
        applied = 1 - in_flight
        assert in_flight == (meta["started"] - 1) % 2      # the last sync started carries it
        lo, hi = bounds[applied]
        assert np.array_equal(mine[lo:hi], agreed[lo:hi]) and np.array_equal(theirs[lo:hi], agreed[lo:hi]), step
        lo, hi = bounds[in_flight]
        assert not np.array_equal(mine[lo:hi], theirs[lo:hi]), step
        # what rode in flight is each rank's own fragment as it was sent (weight x params)
        sent = state.arrays["ranks/0/in_flight_sent"][:hi - lo]
        assert np.any(sent != 0)
        seen.append(in_flight)
    assert seen in ([0, 1, 0, 1], [1, 0, 1, 0]), seen     # the fragments alternate


def test_a_resume_between_fragment_syncs_is_bitwise_exact(tmp_path, digits_h5):
    # int8 wire with residuals, AdamW inside (each rank's moments differ), tau=1: the run stops
    # at step 7 with a fragment in flight, saves (after the stop dropped the sum in flight) and
    # resumes from that checkpoint
    setup = ["policy.anchor=4", "policy.fragments=2", "policy.fragment_delay=1",
             "policy.outer_wire_dtype=int8", "train.epochs=2"]
    _train(tmp_path / "whole", digits_h5, setup + ["checkpoint=off"])
    stopped = tmp_path / "stopped"
    _train(stopped, digits_h5, setup + ["train.max_steps=7"])
    state = read_checkpoint(checkpoints_dir(stopped) / checkpoint_name(7))
    assert state.meta["policy"]["state"]["streaming"]["in_flight"] is not None
    for r in (0, 1):
        assert {f"ranks/{r}/in_flight_sent", f"ranks/{r}/wire/sent_residual", f"ranks/{r}/opt/exp_avg",
                f"ranks/{r}/params"} <= set(state.arrays)
    assert not np.array_equal(state.arrays["ranks/0/opt/exp_avg"], state.arrays["ranks/1/opt/exp_avg"])
    proc = _train(stopped, digits_h5, setup)
    assert "resumed from" in proc.stdout + proc.stderr
    assert _same(_model(stopped), _model(tmp_path / "whole"))


def test_the_coded_outer_wire_is_deterministic_smaller_and_close(tmp_path, digits_h5):
    base = ["checkpoint=off", "policy.anchor=8", "train.epochs=3", "comm.shared_memory=false"]
    runs = {name: base + [f"policy.outer_wire_dtype={name}"] for name in ("null", "bfloat16", "int8", "int4")}
    runs["int8_again"] = runs["int8"]
    for name, extra in runs.items():
        _train(tmp_path / name, digits_h5, extra)
    assert _same(_model(tmp_path / "int8"), _model(tmp_path / "int8_again"))
    sent = {name: sum(r["wire_bytes"] for r in read_metrics(tmp_path / name)) for name in runs}
    # float64 ring Allreduce against coded owner sums: 16 bits a value, 8, 4 (plus the scales)
    assert sent["bfloat16"] < 0.26 * sent["null"], sent
    assert sent["int8"] < 0.6 * sent["bfloat16"], sent
    assert sent["int4"] < 0.6 * sent["int8"], sent
    loss = {name: read_metrics(tmp_path / name)[-1]["val_loss"] for name in runs}
    for name in ("bfloat16", "int8", "int4"):
        assert abs(loss[name] - loss["null"]) < 0.05 * loss["null"], loss
