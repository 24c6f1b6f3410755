"""`comm.on_failure=shrink`: a rank killed with SIGKILL (`debug.fail_mode=kill`) no longer ends
the job. Real `mpirun --with-ft ulfm` jobs under the Open MPI 5 wheel (MPI's ULFM); each job
must exit 0 on the survivors and, in float64, end within 1e-10 of a run that stopped at the
failure's step on the full world (`train.max_steps`) and resumed from that checkpoint on the
survivors' world size. Under MPICH the refusals are in `test_bad_inputs.py`'s table.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.support.jobs import (MPI_IMPL, REPO, explain, launch_prefix, mpi_env, read_log,
                                read_metric_events, train_job, write_small_classification)
from tests.support.mpi_launch import PYTHON, rank_pids

# one pytest-xdist worker: cases that end alike share their reference run (REFERENCES)
pytestmark = [pytest.mark.mpi, pytest.mark.openmpi, pytest.mark.xdist_group("on-failure"),
              pytest.mark.skipif(MPI_IMPL != "openmpi", reason="ULFM: Open MPI 5's mpirun --with-ft ulfm")]

TIMEOUT = 120
SMALL = ["report.plots=false", "data=file", "train.epochs=2", "train.batch_size=24", "model.hidden=[8]",
         "train.dtype=float64", "report.tensorboard=false"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_small_classification(tmp_path_factory.mktemp("on_failure") / "small.h5", 480, 0)


def ulfm_job(n: int, run: Path, overrides: list[str], ft: bool = True) -> subprocess.CompletedProcess:
    """`mpirun --with-ft ulfm [flags] -n N python -m hpc_rlx ...` (without `--with-ft` if not `ft`)."""
    prefix = launch_prefix(n)
    cmd = prefix[:1] + (["--with-ft", "ulfm"] if ft else []) + prefix[1:] + [
        PYTHON, "-m", "hpc_rlx", f"hydra.run.dir={run}", *overrides]
    try:
        return subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"no exit within {TIMEOUT}s: {' '.join(cmd)}\n{e.stdout}\n{e.stderr}")


def model(run: Path) -> dict:
    with h5py.File(run / "model.h5", "r") as f:
        return {k: f[k][...] for k in f}


def tensorboard_marks(run: Path) -> dict:
    """The run's TensorBoard event marks, read with TensorBoard's own reader: the
    `events/world_size` points and the text tags under `events/`."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = accumulator.EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    points = ([(e.step, e.value) for e in acc.Scalars("events/world_size")]
              if "events/world_size" in tags.get("scalars", []) else [])
    return {"world_size": points, "text": [t for t in tags.get("tensors", []) if t.startswith("events/")]}


def assert_ends_as(run: Path, reference: tuple[dict, list]) -> None:
    """The run's model and its epochs' validation losses equal `reference`'s within 1e-10."""
    params, val_losses = reference
    epochs = [r for r in read_metric_events(run) if "epoch" in r]
    assert [r["val_loss"] for r in epochs] == pytest.approx(val_losses, abs=1e-10)
    got = model(run)
    assert sorted(got) == sorted(params)
    worst = max(float(np.max(np.abs(got[k] - params[k]))) for k in got)
    assert worst <= 1e-10, worst


# fixed windows of 4 local steps per rank (4 syncs an epoch here), so a run and its resumed
# reference plan the same windows: async untuned; cadence in lockstep with its anchor pinned
WINDOWED = {"async": ["policy=async", "policy.tune=false", "policy.anchor=4"],
            "cadence": ["policy=cadence", "policy.anchor=4", "policy.max_anchor=4", "policy.max_batch_diff=0",
                        "policy.overhead_target=1e-6"]}


REFERENCES: dict[tuple, dict] = {}


def resumed_reference(tmp_path: Path, data: Path, n: int, survivors: int, step: int,
                      extra: list[str]) -> tuple[dict, list]:
    """The run the shrunk job must equal: `n` ranks to `step`, then resumed on `survivors`:
    its model and its epochs' validation losses."""
    key = (str(data), n, survivors, step, tuple(e for e in extra if not e.startswith("report.")))
    if key not in REFERENCES:
        REFERENCES[key] = _resumed(tmp_path / "reference", data, n, survivors, step, extra)
    return REFERENCES[key]


def _resumed(ref: Path, data: Path, n: int, survivors: int, step: int, extra: list[str]) -> tuple[dict, list]:
    common = [*SMALL, f"data.path={data}", *extra]
    first = train_job(n, ref, [*common, f"train.max_steps={step}"], timeout=TIMEOUT)
    assert first.returncode == 0, explain(first)
    second = train_job(survivors, ref, common, timeout=TIMEOUT)
    assert second.returncode == 0, explain(second)
    assert "re-planned for" in read_log(ref), read_log(ref)
    return model(ref), [r["val_loss"] for r in read_metric_events(ref) if "epoch" in r and not r.get("partial")]


@pytest.mark.parametrize("n, rank, point, step, extra", [
    # ranks 1 and 2 at once, in forward/backward of step 5; the node's shared-memory sum (on by
    # default) is abandoned
    (4, [1, 2], "step", 5, []),
    # rank 1 at step 5, then rank 2 in the recovery from it (once the survivors have shrunk):
    # they shrink again, one record for both; the same reference as the case above
    (4, [1, 2], "recovery", 5, []),
    # the next three end alike (the first step of epoch 2 is redone on 2 ranks): one reference
    # just before the step's Allreduce, MPI's own Allreduce
    (3, 1, "allreduce", 16, ["comm.shared_memory=false", "report.tensorboard=true"]),
    # rank 0, the writer of the run directory: the survivors' rank 0 takes it over
    (3, 0, "step", 16, ["comm.shared_memory=false"]),
    # before the validation of epoch 1: the survivors redo it over themselves
    (3, 2, "validation", 16, ["comm.shared_memory=false"]),
    # before the checkpoint of step 16 (checkpoint.every_steps=16, the shrunk job only), with LoRA
    # adapters (model.lora.*): the frozen base, the adapters' bucket and their checkpoint record
    # carry over to the survivors
    (3, 1, "checkpoint", 16, ["comm.shared_memory=false", "model.lora.rank=2", "model.lora.targets=[fc*]",
                              "model.train_only=[head.*]"]),
    # rank 0, which scatters the rows and streams them: the survivors' rank 0 reads and sends them
    (3, 0, "step", 16, ["comm.shared_memory=false", "data.distribution=scatter", "data.cache=stream"]),
    # the step's Allreduce overlapped with backward (chunks in flight when the rank dies), and
    # the 16-bit wire (its segments re-planned over the survivors)
    (3, 1, "step", 16, ["comm.shared_memory=false", "comm.overlap=true"]),
    (3, 2, "allreduce", 16, ["comm.shared_memory=false", "comm.wire_dtype=bfloat16"]),
], ids=["kill_two_ranks_in_forward_backward", "kill_a_rank_during_the_recovery", "kill_at_the_allreduce", "kill_rank_0", "kill_before_validation",
        "kill_before_a_checkpoint_with_lora_adapters", "kill_rank_0_that_scatters_streamed_rows", "kill_with_the_allreduce_overlapped",
        "kill_with_the_16_bit_wire"])
def test_shrink_survives_a_killed_rank_and_ends_as_a_resume_on_the_survivors(tmp_path, data, n, rank,
                                                                             point, step, extra):
    run = tmp_path / "run"
    dead = rank if isinstance(rank, list) else [rank]
    saves = ["checkpoint.every_steps=16"] if point == "checkpoint" else []
    proc = ulfm_job(n, run, [*SMALL, f"data.path={data}", *extra, *saves, "comm.on_failure=shrink",
                             f"debug.fail_rank={'[' + ','.join(map(str, dead)) + ']'}", f"debug.fail_point={point}",
                             f"debug.fail_step={step}", "debug.fail_mode=kill"])
    assert proc.returncode == 0, explain(proc)
    summary = json.loads((run / "summary.json").read_text())
    left = n - len(dead)
    assert summary["status"] == "completed" and summary["world_size"] == left, summary
    (failure,) = summary["failures"]
    assert failure["step"] == step and failure["ranks"] == dead, failure
    assert failure["world_size_after"] == left and len(failure["hosts"]) == len(dead), failure
    assert failure["recovery_s"] < 10, failure
    assert len(summary["ranks"]) == left
    events = [r for r in read_metric_events(run) if r.get("event") == "failure"]
    assert events == [{"event": "failure", **failure}], events
    log = read_log(run)
    assert "failures: comm.on_failure=shrink" in log, log
    who = ", ".join(rf"{r} on \S+" for r in dead)
    assert re.search(rf"ranks? {who} failed: {left} of {n} ranks train on from step {step}", log), log
    if not extra:
        assert "shared-memory sum is off for the rest of the run" in log, log
    if dead == [0]:
        assert re.search(r"rank 0 on \S+ \(rank 1 of the job\) writes the run directory from here on", log), log
    if saves:       # redone by the survivors, complete; the final one after it
        with h5py.File(run / "checkpoints" / "ckpt-00000016.h5", "r") as f:
            assert len(f.keys()) > 0
        assert "checkpoint (cadence) at step 16" in log, log
    epochs = [r for r in read_metric_events(run) if "epoch" in r]
    assert [r["epoch"] for r in epochs] == [1, 2], epochs
    assert re.search(rf"completed in .*; {len(dead)} ranks? failed during the run, {left} trained to the end", log), log
    assert "STALL" not in proc.stderr and "watchdog" in summary, summary     # rebuilt over the survivors
    assert "Traceback" not in proc.stderr, explain(proc)
    report = subprocess.run([PYTHON, "-m", "hpc_rlx.report", str(run), "--no-plots"], cwd=REPO,
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert re.search(rf"failure: ranks? {who} lost at step {step}; {left} ranks trained on after", report.stdout), \
        report.stdout + report.stderr
    if "report.tensorboard=true" in extra:
        marks = tensorboard_marks(run)
        assert marks["world_size"] == [(step, float(left))], marks
        assert marks["text"] and all(t.startswith("events/failure") for t in marks["text"]), marks

    assert_ends_as(run, resumed_reference(tmp_path, data, n, left, step, extra))


UNINTERRUPTED: dict[tuple, tuple] = {}


def uninterrupted(tmp_path: Path, data: Path, n: int, extra: tuple = ()) -> tuple[dict, list]:
    """A plain run on `n` ranks (with `extra` settings): its model and its epochs' validation losses."""
    key = (str(data), n, tuple(extra))
    if key not in UNINTERRUPTED:
        ref = tmp_path / "uninterrupted"
        proc = train_job(n, ref, [*SMALL, f"data.path={data}", *extra], timeout=TIMEOUT)
        assert proc.returncode == 0, explain(proc)
        UNINTERRUPTED[key] = (model(ref), [r["val_loss"] for r in read_metric_events(ref) if "epoch" in r])
    return UNINTERRUPTED[key]


@pytest.mark.parametrize("dead, point, step, extra", [
    # in forward/backward, the node's shared-memory sum on: the spare trains shard 1
    ([1], "step", 5, []),
    # rank 0, the writer, at the Allreduce of epoch 2: the spare trains shard 0 as rank 0
    ([0], "allreduce", 20, ["comm.shared_memory=false"]),
], ids=["kill_rank_1", "kill_rank_0"])
def test_a_spare_takes_the_dead_ranks_place_and_the_run_equals_an_uninterrupted_one(tmp_path, data, dead,
                                                                                     point, step, extra):
    """comm.on_failure=spare, 2 ranks that train and 1 spare (the job's rank 2): the spare holds
    the model and takes part in every step with no rows; when a rank dies it takes that rank's
    shard, so the world size and the data plan stay, and in float64 the run ends where a plain
    2-rank run ends."""
    run = tmp_path / "run"
    proc = ulfm_job(3, run, [*SMALL, f"data.path={data}", *extra, "comm.on_failure=spare", "comm.spares=1",
                             f"debug.fail_rank={dead[0]}", f"debug.fail_point={point}", f"debug.fail_step={step}",
                             "debug.fail_mode=kill"])
    assert proc.returncode == 0, explain(proc)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["spares_left"] == 0, summary
    (failure,) = summary["failures"]
    assert failure["step"] == step and failure["ranks"] == dead and failure["replaced_by"] == [2], failure
    assert failure["world_size_after"] == 2 and failure["spares_left"] == 0, failure
    assert [r["spare"] for r in summary["ranks"]] == [False, False], summary["ranks"]
    log = read_log(run)
    assert "2 ranks and 1 spare(s)" in log and "1 spare rank(s): 2" in log, log
    assert re.search(rf"rank {dead[0]} on \S+ failed: spare rank 2 on \S+ trains shard {dead[0]}; 2 ranks train "
                     rf"on from step {step}, 0 spares left \(comm\.on_failure=spare", log), log
    if dead == [0]:
        assert re.search(r"rank 0 on \S+ \(rank 2 of the job\) writes the run directory from here on", log), log
    assert "Traceback" not in proc.stderr, explain(proc)
    assert_ends_as(run, uninterrupted(tmp_path, data, 2))


def test_when_the_spares_are_used_up_spare_goes_on_as_shrink(tmp_path, data):
    """3 ranks that train and 1 spare; ranks 1 and 2 die at once: the spare takes shard 1 and
    the two left close up over 2 shards, as a resume on 2 ranks from that step would."""
    run = tmp_path / "run"
    proc = ulfm_job(4, run, [*SMALL, f"data.path={data}", "comm.on_failure=spare", "comm.spares=1",
                             "debug.fail_rank=[1,2]", "debug.fail_point=step", "debug.fail_step=5",
                             "debug.fail_mode=kill"])
    assert proc.returncode == 0, explain(proc)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["spares_left"] == 0, summary
    (failure,) = summary["failures"]
    assert failure["ranks"] == [1, 2] and failure["replaced_by"] == [3] and failure["world_size_after"] == 2, failure
    log = read_log(run)
    assert re.search(r"ranks 1 on \S+, 2 on \S+ failed: spare rank 3 on \S+ trains shard 1; no spare left, 2 of 3 "
                     r"ranks train on from step 5 \(comm\.on_failure=spare goes on as shrink", log), log
    assert_ends_as(run, resumed_reference(tmp_path, data, 3, 2, 5, []))


@pytest.mark.parametrize("dead, point, extra", [
    ([1], "startup", ["comm.on_failure=shrink"]),                      # just after the spec's broadcast
    ([0], "broadcast", ["comm.on_failure=shrink"]),                    # rank 0, before the weights' broadcast
    ([1], "data", ["comm.on_failure=spare", "comm.spares=1"]),         # data loading; the spare trains shard 1
    # before it receives the spec (rank 0 sends it again to the survivors, planned for them);
    # policy=async: its per-rank slots and controller sized for the survivors
    ([2], "spec", ["comm.on_failure=shrink", *WINDOWED["async"]]),
], ids=["startup", "rank_0_at_the_weights_broadcast", "spare_at_data_loading", "async_during_the_spec_broadcast"])
def test_a_rank_that_dies_before_training_starts_the_run_over_on_the_survivors(tmp_path, data, dead, point, extra):
    """Before the first step the survivors hold nothing a fresh setup does not rebuild: they
    shrink and set the run up again; the run then equals a plain run on 2 ranks."""
    run = tmp_path / "run"
    proc = ulfm_job(3, run, [*SMALL, f"data.path={data}", *extra, f"debug.fail_rank={dead[0]}",
                             f"debug.fail_point={point}", "debug.fail_mode=kill"])
    assert proc.returncode == 0, explain(proc)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2, summary
    (failure,) = summary["failures"]
    assert failure["step"] == 0 and failure["ranks"] == dead and failure["world_size_after"] == 2, failure
    mode = extra[0].split("=")[1]
    # the host of a rank dead before the spec's broadcast is not known (no rank had asked it yet)
    where = r"" if point == "spec" else r" on \S+"
    assert re.search(rf"rank {dead[0]}{where} died before training started: 2 of {2 if mode == 'spare' else 3} ranks "
                     rf"set the run up again \(comm\.on_failure={mode}\)", proc.stdout), explain(proc)
    assert re.search(r"on 2 ranks(;|$)", proc.stdout, flags=re.M), explain(proc)    # the plan line, for the survivors
    assert "Traceback" not in proc.stderr, explain(proc)
    assert_ends_as(run, uninterrupted(tmp_path, data, 2, tuple(e for e in extra if e.startswith("policy"))))


def test_rank_0_dead_before_it_sent_the_spec_ends_the_job_with_one_line(tmp_path, data):
    """Before the spec's broadcast no other rank has the job: whatever comm.on_failure, the
    survivors end it with one line and exit 2, no traceback, no hang."""
    proc = ulfm_job(3, tmp_path / "run", [*SMALL, f"data.path={data}", "comm.on_failure=shrink", "debug.fail_rank=0",
                                          "debug.fail_point=spec", "debug.fail_mode=kill"])
    assert proc.returncode == 2, explain(proc)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpc_rlx: error")]
    assert len(errors) == 1, explain(proc)
    assert re.search(r"\(RankFailure, .*\): rank 0 died before it sent the job's spec: no other rank holds the job",
                     errors[0]), errors[0]
    assert "Traceback" not in proc.stderr, explain(proc)


def test_the_stall_watchdog_watches_the_survivors(tmp_path, data):
    """Rebuilt over the survivors after the failure: a rank 3 s late at step 20 is reported."""
    run = tmp_path / "run"
    proc = ulfm_job(3, run, [*SMALL, f"data.path={data}", "comm.shared_memory=false", "comm.on_failure=shrink",
                             "debug.fail_rank=2", "debug.fail_point=step", "debug.fail_step=5",
                             "debug.fail_mode=kill", "comm.stall_warning_s=1", "debug.stall_rank=1",
                             "debug.stall_step=20", "debug.stall_s=3"])
    assert proc.returncode == 0, explain(proc)
    assert re.search(r"STALL: collective .* at step 2\d has waited", proc.stderr), explain(proc)
    assert re.search(r"not arrived \(1/2\): ranks 1", proc.stderr), explain(proc)
    assert json.loads((run / "summary.json").read_text())["watchdog"]["stall_reports"] >= 1


def test_shrink_without_with_ft_ulfm_is_refused_on_every_rank(tmp_path, data):
    proc = ulfm_job(2, tmp_path / "run", [*SMALL, f"data.path={data}", "comm.on_failure=shrink"], ft=False)
    assert proc.returncode == 2, explain(proc)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpc_rlx: error")]
    assert len(errors) == 1, explain(proc)
    assert re.search(r"\(ConfigError, reported by rank 0 on \S+\): comm\.on_failure=shrink needs MPI's fault "
                     r"tolerance \(ULFM\), which this job does not have: Open MPI v5\S* was launched without "
                     r"--with-ft ulfm .*; launch with Open MPI 5.s `mpirun --with-ft ulfm -n N python -m hpc_rlx "
                     r"comm\.on_failure=shrink", errors[0]), errors[0]
    assert "Traceback" not in proc.stderr and "aborting" not in proc.stderr, explain(proc)


@pytest.mark.parametrize("policy, dead, point, step, extra", [
    # in its local steps of window 3: the survivors drop the window in flight (the node's
    # shared-memory sum on)
    ("async", 1, "step", 3, []),
    # at the sync's Allreduce in epoch 2, cadence
    ("cadence", 2, "allreduce", 5, ["comm.shared_memory=false"]),
    # rank 0: the survivors take their rank 0's inner state, which a resume from the dead rank
    # 0's checkpoint would not; DiLoCo resetting the inner state at every sync makes them equal;
    # the coded outer wire's residuals dropped, as a resume on another world size does
    ("async", 0, "allreduce", 2, ["comm.shared_memory=false", "policy.outer=diloco", "policy.reset_inner=true",
                                  "policy.outer_wire_dtype=int8"]),
    # before the validation of epoch 1, whose windows are done: it is redone over the survivors
    ("async", 2, "validation", 4, ["comm.shared_memory=false"]),
], ids=["async_in_local_steps", "cadence_at_the_sync", "async_rank_0_diloco_coded_wire", "async_before_validation"])
def test_windowed_policies_drop_the_window_in_flight_and_end_as_a_resume(tmp_path, data, policy, dead, point,
                                                                          step, extra):
    """`policy=cadence|async` under shrink: every survivor goes back to the last sync (the agreed
    model, its inner state as that sync left it), takes rank 0's inner state, and the policy is
    set up again over 2 ranks (per-rank bucket slots, controller, local passes) as a resume from
    that sync's checkpoint on 2 ranks would be."""
    run = tmp_path / "run"
    extra = [*WINDOWED[policy], *extra]
    proc = ulfm_job(3, run, [*SMALL, f"data.path={data}", *extra, "comm.on_failure=shrink", f"debug.fail_rank={dead}",
                             f"debug.fail_point={point}", f"debug.fail_step={step}", "debug.fail_mode=kill"])
    assert proc.returncode == 0, explain(proc)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2, summary
    (failure,) = summary["failures"]
    assert failure["step"] == step and failure["ranks"] == [dead] and failure["world_size_after"] == 2, failure
    log = read_log(run)
    assert re.search(rf"rank {dead} on \S+ failed: 2 of 3 ranks train on from step {step}", log), log
    assert (f"policy={policy}: the window in flight is dropped; the survivors go on from the sync of step {step} "
            f"with rank 0's inner optimizer state, as a resume on 2 ranks would") in log, log
    epochs = [r for r in read_metric_events(run) if "epoch" in r]
    assert [r["epoch"] for r in epochs] == [1, 2] and all(r["policy"] == policy for r in epochs), epochs
    assert "Traceback" not in proc.stderr, explain(proc)
    assert_ends_as(run, resumed_reference(tmp_path, data, 3, 2, step, extra))


def test_rank_0_killed_as_it_scatters_a_streamed_round(tmp_path, data):
    """`debug.fail_point=scatter`: rank 0 dies as it posts the round of rows for the window from
    step 18 (posted one window ahead, while an earlier window trains) under
    `data.distribution=scatter data.cache=stream`: the survivors' rank 0 reads and sends the
    rows from then on, and the run equals 3 ranks to the record's step resumed on 2."""
    run = tmp_path / "run"
    extra = ["comm.shared_memory=false", "data.distribution=scatter", "data.cache=stream"]
    proc = ulfm_job(3, run, [*SMALL, f"data.path={data}", *extra, "comm.on_failure=shrink", "debug.fail_rank=0",
                             "debug.fail_point=scatter", "debug.fail_step=18", "debug.fail_mode=kill"])
    assert proc.returncode == 0, explain(proc)
    summary = json.loads((run / "summary.json").read_text())
    (failure,) = summary["failures"]
    assert failure["ranks"] == [0] and 0 < failure["step"] < 18 and summary["world_size"] == 2, summary
    assert re.search(r"rank 0 on \S+ \(rank 1 of the job\) writes the run directory from here on", read_log(run))
    assert "Traceback" not in proc.stderr, explain(proc)
    assert_ends_as(run, resumed_reference(tmp_path, data, 3, 2, failure["step"], extra))


@pytest.mark.parametrize("policy, dead, point, step", [
    ("async", 1, "step", 3),            # in its local steps of window 3
    ("cadence", 0, "allreduce", 5),     # rank 0 at the sync of step 5: the spare becomes rank 0
], ids=["async_rank_1_in_local_steps", "cadence_rank_0_at_the_sync"])
def test_a_spare_takes_a_windowed_ranks_place_and_the_run_equals_an_uninterrupted_one(tmp_path, data, policy,
                                                                                      dead, point, step):
    """comm.on_failure=spare under cadence/async with policy.reset_inner=true (no rank keeps
    state of its own from one sync to the next): the spare adds nothing to the syncs, tracks
    every rank's position, and when a rank dies all drop the window in flight and redo it with
    the spare on the dead rank's shard: in float64 the run ends where a plain 2-rank run ends."""
    run = tmp_path / "run"
    settings = [*WINDOWED[policy], "policy.reset_inner=true", "comm.shared_memory=false"]
    proc = ulfm_job(3, run, [*SMALL, f"data.path={data}", *settings, "comm.on_failure=spare", "comm.spares=1",
                             f"debug.fail_rank={dead}", f"debug.fail_point={point}", f"debug.fail_step={step}",
                             "debug.fail_mode=kill"])
    assert proc.returncode == 0, explain(proc)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["spares_left"] == 0, summary
    (failure,) = summary["failures"]
    assert failure["step"] == step and failure["ranks"] == [dead] and failure["replaced_by"] == [2], failure
    assert re.search(rf"rank {dead} on \S+ failed: spare rank 2 on \S+ trains shard {dead}", read_log(run))
    assert "Traceback" not in proc.stderr, explain(proc)
    assert_ends_as(run, uninterrupted(tmp_path, data, 2, tuple(settings)))


# Open MPI's own failure detector (heartbeats from a thread of each rank): a rank is suspected
# after `mpi_ft_detector_timeout` s without one
DETECTOR = ["--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_thread", "true",
            "--mca", "mpi_ft_detector_period", "1", "--mca", "mpi_ft_detector_timeout", "4"]


def test_a_hung_rank_is_declared_failed_by_the_detector_and_the_survivors_shrink_past_it(tmp_path, data):
    """Rank 2 of 3 frozen (SIGSTOP: alive, silent) once the progress shows step 5: with Open MPI's
    failure detector on (4 s timeout: a live rank's heartbeat thread on this loaded 2-core
    machine must not miss it) ULFM declares it failed and the survivors shrink past it, about 4 s
    after the freeze, with no stall report; the run ends as 3 ranks to the record's step
    resumed on 2. mpirun then waits for the frozen process, which the test kills."""
    run = tmp_path / "run"
    prefix = launch_prefix(3)
    cmd = prefix[:1] + ["--with-ft", "ulfm", *DETECTOR] + prefix[1:] + [
        PYTHON, "-m", "hpc_rlx", f"hydra.run.dir={run}", *SMALL, f"data.path={data}", "comm.shared_memory=false",
        "comm.on_failure=shrink", "train.progress=lines", "train.log_every_s=0.01",
        "debug.slowdown={0:100.0,1:100.0,2:100.0}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic(), ln)) for ln in proc.stdout], daemon=True)
    reader.start()
    frozen = None
    try:
        deadline = time.monotonic() + TIMEOUT
        while not any("global step 5)" in ln for _, ln in lines) and time.monotonic() < deadline:
            assert proc.poll() is None, "".join(ln for _, ln in lines)
            time.sleep(0.02)
        frozen = rank_pids(proc.pid)[2]
        os.kill(frozen, signal.SIGSTOP)
        t_freeze = time.monotonic()
        while not (run / "summary.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (run / "summary.json").exists(), "".join(ln for _, ln in lines)
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGKILL)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("mpirun did not end once the frozen rank was killed:\n" + "".join(ln for _, ln in lines))
        reader.join(timeout=10)
    out = "".join(ln for _, ln in lines)
    assert rc == 0, out
    (failure,) = json.loads((run / "summary.json").read_text())["failures"]
    assert failure["ranks"] == [2] and failure["world_size_after"] == 2, failure
    noticed = next(t for t, ln in lines if "rank 2 on" in ln and "failed:" in ln)
    assert noticed - t_freeze < 4 + 3, f"{noticed - t_freeze:.1f} s from the freeze to the recovery line"
    assert "STALL" not in out, out
    assert_ends_as(run, resumed_reference(tmp_path, data, 3, 2, failure["step"], ["comm.shared_memory=false"]))


def test_spares_used_up_by_three_deaths_end_the_job_with_exit_0(tmp_path, data):
    """6 ranks, 2 spares; world ranks 3, 2 and then 4 (the spare that took shard 3) killed as the
    run goes: the renumbered communicators each recovery trains on are the ones the job
    channel's last word follows (it went to a communicator with a dead rank in it: exit 1 and a
    traceback on every survivor), so the job ends with exit 0 and its three records."""
    run = tmp_path / "run"
    prefix = launch_prefix(6)
    cmd = prefix[:1] + ["--with-ft", "ulfm"] + prefix[1:] + [
        PYTHON, "-m", "hpc_rlx", f"hydra.run.dir={run}", *SMALL, f"data.path={data}", "comm.on_failure=spare",
        "comm.spares=2", "comm.shared_memory=false", "train.progress=lines", "train.log_every_s=0.01",
        "train.epochs=6", "debug.slowdown={" + ",".join(f"{r}:300.0" for r in range(6)) + "}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: [lines.append(ln) for ln in proc.stdout], daemon=True)
    reader.start()

    def last_step() -> int:     # the progress lines skip steps: the highest one printed so far
        return max((int(m.group(1)) for ln in list(lines) for m in [re.search(r"global step (\d+)\)", ln)] if m),
                   default=0)

    try:
        deadline, pids, killed_at = time.monotonic() + TIMEOUT, {}, 0
        for k, rank in enumerate((3, 2, 4)):
            # each death once the run has recovered from the one before and gone 3 steps on
            while sum("failed:" in ln for ln in list(lines)) < k or last_step() < killed_at + 3:
                assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
                time.sleep(0.02)
            while len(pids) < 6:
                pids = rank_pids(proc.pid)
            killed_at = last_step()
            os.kill(pids[rank], signal.SIGKILL)
        rc = proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=10)
    out = "".join(lines)
    assert rc == 0, out
    assert "Traceback" not in out and "MPI_ERR_PROC_FAILED" not in out, out
    summary = json.loads((run / "summary.json").read_text())
    assert [f["ranks"] for f in summary["failures"]] == [[3], [2], [4]], summary["failures"]
    assert summary["world_size"] == 3 and summary["spares_left"] == 0, summary
    assert (run / "model.h5").is_file()


@pytest.mark.parametrize("dead", [1, 0])
def test_a_rank_lost_after_the_last_step_ends_the_job_with_exit_0(tmp_path, data, dead):
    """debug.fail_point=finish: a rank killed after the final checkpoint, before the run's summary
    is gathered. The survivors redo the end over their own communicator and write the model
    and the summary (the survivors' rank 0 when rank 0 died), the failure recorded: exit 0."""
    run = tmp_path / "run"
    proc = ulfm_job(3, run, [*SMALL, f"data.path={data}", "comm.on_failure=shrink", f"debug.fail_rank={dead}",
                             "debug.fail_point=finish", "debug.fail_mode=kill"])
    assert proc.returncode == 0, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2, summary
    (failure,) = summary["failures"]
    assert failure["ranks"] == [dead] and failure["step"] == summary["steps"], failure
    assert len(summary["ranks"]) == 2
    final = model(run)
    with h5py.File(sorted((run / "checkpoints").glob("ckpt-*.h5"))[-1], "r") as ckpt:
        for name, value in final.items():      # the model is the final checkpoint's parameters
            np.testing.assert_array_equal(value, ckpt["params"][name][...] if "params" in ckpt else value)
