"""Faults under real mpirun: an exception at each point, a SIGKILLed rank, a stalled collective,
non-finite values. No fault may leave a rank waiting, and none may lose or corrupt work."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.support.jobs import (REPO, explain, launch_cmd, mpi_env, rank_pids, read_metrics, train_job,
                       write_small_classification)

pytestmark = pytest.mark.mpi

HOST = socket.gethostname().split(".")[0]
# 96 training rows, global batch 8: 12 steps per epoch on any world size
BASE = ["data=file", "data.val_fraction=0.2", "train.batch_size=8", "model.hidden=[8]"]


@pytest.fixture(scope="module")
def small_h5(tmp_path_factory) -> Path:
    return write_small_classification(tmp_path_factory.mktemp("faults") / "small.h5", rows=120, seed=1)


def failure_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if re.match(r"hpc_rlx: (error|rank \d+ on )", ln)]


def checkpoint_steps(run: Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in (run / "checkpoints").glob("ckpt-*.h5"))


# --------------------------------------------------------------------------------------
# An exception on one rank at each point
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("rank,point,phase,step", [
    (1, "startup", "during startup", None),
    (1, "data", "during data loading", 0),
    pytest.param(1, "step", "during a training step", 3, marks=pytest.mark.openmpi),
    (0, "step", "during a training step", 3),
    pytest.param(1, "checkpoint", "during checkpointing", 12, marks=pytest.mark.openmpi),
])
def test_exception_at_each_point_is_one_message_and_the_job_ends(tmp_path, small_h5, rank, point, phase, step):
    run = tmp_path / "run"
    t0 = time.monotonic()
    proc = train_job(2, run, BASE + [f"data.path={small_h5}", "train.epochs=2", f"debug.fail_rank={rank}",
                                     f"debug.fail_point={point}", "debug.fail_step=3",
                                     "checkpoint.every_epochs=1"], timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0, explain(proc)
    lines = failure_lines(proc.stderr)
    assert len(lines) == 1, explain(proc)
    line = lines[0]
    # rank, host, what it was doing, step, cause
    assert f"rank {rank} on {HOST}" in line, line
    assert phase in line, line
    if step is not None:
        assert f"at step {step}" in line, line
    assert f"InjectedFailure: injected failure (debug.fail_point={point})" in line, line
    assert "Error executing job" not in proc.stderr, explain(proc)   # no second report from Hydra
    assert elapsed < 30, f"took {elapsed:.1f}s"
    if point == "checkpoint":
        assert checkpoint_steps(run) == [], "a checkpoint was written although its rank failed"


# --------------------------------------------------------------------------------------
# A rank killed with SIGKILL mid-training
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("victim", [pytest.param(0, marks=pytest.mark.openmpi),
                                    pytest.param(1, marks=pytest.mark.slow)])
def test_sigkill_of_one_rank_ends_the_job_and_resume_continues(tmp_path, small_h5, victim):
    from hpc_rlx.checkpoint import read_checkpoint

    run = tmp_path / "run"
    overrides = BASE + [f"data.path={small_h5}", "train.epochs=30", "checkpoint.every_steps=5",
                        "checkpoint.keep_last=3"]
    cmd = launch_cmd(2, ["-m", "hpc_rlx", f"hydra.run.dir={run}", "report.plots=false",
                         *overrides, "debug.slowdown={0: 300, 1: 300}"])
    proc = subprocess.Popen(cmd, cwd=REPO, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while len(checkpoint_steps(run) if (run / "checkpoints").exists() else []) < 2:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "no checkpoint within 60 s"
            time.sleep(0.1)
        pids = rank_pids(proc.pid)
        assert set(pids) == {0, 1}, pids
        t_kill = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        ended_after = time.monotonic() - t_kill
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0, out
    assert ended_after < 60
    steps = checkpoint_steps(run)
    assert steps, out
    # the newest checkpoint that made it to disk is whole (a write cut short stays a temp file)
    newest = run / "checkpoints" / f"ckpt-{steps[-1]:08d}.h5"
    state = read_checkpoint(newest)
    assert int(state.meta["step"]) == steps[-1]
    assert bool(np.isfinite(state.arrays["params"]).all())

    # resume=auto in the same run dir continues from it, to the end
    proc2 = train_job(2, run, overrides + ["resume=auto"], timeout=120)
    assert proc2.returncode == 0, explain(proc2)
    m = re.search(r"resumed from (\S+ckpt-(\d+)\.h5)", proc2.stdout)
    assert m, explain(proc2)
    assert int(m.group(2)) >= steps[-1] - 5     # the newest, or a valid older one with a warning
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 30 * 12 and summary["resumed_from"] == m.group(1)


# --------------------------------------------------------------------------------------
# The stall watchdog
# --------------------------------------------------------------------------------------

@pytest.mark.openmpi
def test_stall_warning_names_the_step_and_the_missing_rank(tmp_path, small_h5):
    run = tmp_path / "run"
    proc = train_job(2, run, BASE + [f"data.path={small_h5}", "train.epochs=1", "comm.stall_warning_s=1",
                                     "debug.stall_rank=1", "debug.stall_step=3", "debug.stall_s=3.5"],
                     timeout=60)
    assert proc.returncode == 0, explain(proc)   # a warning only: the job goes on
    err = proc.stderr
    assert re.search(r"STALL: collective 'fused-bucket Allreduce' at step 3 has waited \d+\.\d s", err), explain(proc)
    assert "arrived (1/2): ranks 0" in err and "not arrived (1/2): ranks 1" in err, explain(proc)
    assert re.search(rf"rank 1 on {HOST}: busy outside any collective at step 3 for \d", err), explain(proc)
    assert err.count("STALL:") == 1, explain(proc)   # one report per stall
    assert len(read_metrics(run)) == 1


@pytest.mark.openmpi
def test_stall_abort_ends_the_job_with_the_report(tmp_path, small_h5):
    run = tmp_path / "run"
    t0 = time.monotonic()
    proc = train_job(2, run, BASE + [f"data.path={small_h5}", "train.epochs=1", "comm.stall_warning_s=1",
                                     "comm.stall_abort_s=3", "debug.stall_rank=0", "debug.stall_step=5",
                                     "debug.stall_s=120"], timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0, explain(proc)
    assert elapsed < 40, f"the stalled job took {elapsed:.1f}s to end"
    err = proc.stderr
    assert "at step 5" in err and "not arrived (1/2): ranks 0" in err, explain(proc)
    assert re.search(r"stalled for \d+\.\d s >= comm\.stall_abort_s=3: aborting all 2 ranks", err), explain(proc)
    assert not (run / "metrics.jsonl").exists() or read_metrics(run) == []


# --------------------------------------------------------------------------------------
# Non-finite values
# --------------------------------------------------------------------------------------

def test_nonfinite_skip_skips_the_step_everywhere_and_counts_it(tmp_path, small_h5):
    run = tmp_path / "run"
    proc = train_job(2, run, BASE + [f"data.path={small_h5}", "train.epochs=2", "train.on_nonfinite=skip",
                                     "debug.nan_rank=1", "debug.nan_step=4"], timeout=60)
    assert proc.returncode == 0, explain(proc)
    metrics = read_metrics(run)
    assert [m["skipped_steps"] for m in metrics] == [1, 1]
    assert all(np.isfinite(m["train_loss"]) and np.isfinite(m["val_loss"]) for m in metrics), metrics
    summary = json.loads((run / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["steps"] == 24
    with h5py.File(run / "model.h5", "r") as f:
        assert all(np.isfinite(f[k][...]).all() for k in f.keys())


def test_nonfinite_stop_keeps_the_last_good_checkpoint(tmp_path, small_h5):
    from hpc_rlx.checkpoint import read_checkpoint

    run = tmp_path / "run"
    proc = train_job(2, run, BASE + [f"data.path={small_h5}", "train.epochs=3", "train.on_nonfinite=stop",
                                     "debug.nan_rank=0", "debug.nan_step=15", "checkpoint.every_epochs=1"],
                     timeout=60)
    assert proc.returncode == 2, explain(proc)
    lines = failure_lines(proc.stderr)
    assert len(lines) == 1 and "NonFiniteError" in lines[0], explain(proc)
    assert "non-finite loss or gradient at step 15" in lines[0], explain(proc)
    # epoch 1's checkpoint (step 12) is the newest: nothing was written from the bad state
    assert checkpoint_steps(run) == [12], explain(proc)
    state = read_checkpoint(run / "checkpoints" / "ckpt-00000012.h5")
    assert np.isfinite(state.arrays["params"]).all()
    with h5py.File(run / "model.h5", "r") as f:
        assert all(np.isfinite(f[k][...]).all() for k in f.keys())


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_skip_fails_when_the_model_only_produces_non_finite_steps(tmp_path, small_h5, policy):
    # An absurd learning rate overflows the weights: every later step is non-finite, which
    # `skip` must not turn into a run that "finishes" without training.
    run = tmp_path / "run"
    proc = train_job(2, run, BASE + [f"data.path={small_h5}", "train.epochs=3", "train.on_nonfinite=skip",
                                     "optim.lr=1e30", "optim.momentum=0", "train.max_consecutive_skips=5",
                                     "checkpoint=off", f"policy={policy}"], timeout=60)
    assert proc.returncode == 2, explain(proc)
    lines = failure_lines(proc.stderr)
    assert len(lines) == 1 and "5 consecutive steps had NaN/Inf" in lines[0], explain(proc)
    assert not (run / "model.h5").exists()      # no model from a run that did not train


def test_a_checkpoint_of_non_finite_parameters_is_refused():
    from types import SimpleNamespace

    from hpc_rlx.base.errors import CheckpointError
    from hpc_rlx.runtime.train import Run

    fake = SimpleNamespace(worker=SimpleNamespace(params=np.array([1.0, np.inf, np.nan], np.float32), step=7),
                           rank=1)
    with pytest.raises(CheckpointError, match=r"2 parameter value\(s\) on rank 1 are NaN/Inf at step 7"):
        Run._check_params_finite(fake)
    Run._check_params_finite(SimpleNamespace(worker=SimpleNamespace(params=np.ones(3), step=1), rank=0))


# --------------------------------------------------------------------------------------
# The watchdog itself, in-process: the report, the UDP side channel, the cost per collective
# --------------------------------------------------------------------------------------

class FakeComm:
    """Just enough of a communicator to build a watchdog as `rank` of `size` in one process."""

    def __init__(self, rank: int, size: int, root_addr=None):
        from hpc_rlx.comm.heartbeat import JobSecret

        self.rank, self.size, self.root_addr = rank, size, root_addr
        self.secret = JobSecret.draw()        # what rank 0 would have sent over MPI
        self.calls: list[str] = []

    def allgather(self, x):
        return [x] * self.size       # every rank on this host: the side channel stays on loopback

    def bcast(self, x, root=0):
        return x if self.rank == root else (self.root_addr, self.secret.as_tuple())

    def gather(self, x, root=0):
        return [x] * self.size if self.rank == root else None

    def Allreduce(self, *args, **kwargs):
        self.calls.append("Allreduce")


def test_stall_report_names_the_collective_the_step_and_each_missing_rank():
    from hpc_rlx.comm.watchdog import stall_report

    now = 100.0
    states = {
        0: {"label": "fused-bucket Allreduce", "step": 7, "for": 4.0, "recv": 99.0},
        2: {"label": "fused-bucket Allreduce", "step": 7, "for": 4.5, "recv": 99.5},
        1: {"label": None, "step": None, "at": 7, "for": 4.8, "recv": 99.8,
            "last": ["fused-bucket Allreduce", 6]},
        3: {"label": "fused-bucket Allreduce", "step": 7, "for": 0.1, "recv": 80.0},   # silent since
    }
    hosts = {0: "a", 1: "b", 2: "a", 3: "c"}
    assert stall_report(states, 5, now, warn_s=60, silent_after=3, hosts=hosts) is None
    text, key = stall_report(states, 5, now, warn_s=3, silent_after=3, hosts=hosts)
    assert key[:2] == ("fused-bucket Allreduce", 7)
    assert "collective 'fused-bucket Allreduce' at step 7 has waited 5.0 s" in text
    assert "arrived (2/5): ranks 0,2" in text and "not arrived (3/5): ranks 1,3-4" in text
    assert "rank 1 on b: busy outside any collective at step 7 for 5.0 s (last left 'fused-bucket Allreduce' at step 6)" in text
    assert "rank 3 on c: silent: no heartbeat for 20.0 s" in text
    assert "rank 4 on ?: heartbeats cannot reach rank 0: none has arrived" in text


def test_watchdog_reports_over_udp_then_aborts(monkeypatch):
    import io
    import threading

    from hpc_rlx.comm.watchdog import StallWatchdog

    out, aborted = io.StringIO(), threading.Event()
    wd = StallWatchdog(FakeComm(0, 2), warn_s=0.3, abort_s=1.0, position=lambda: 4, out=out,
                       abort=lambda code: aborted.set())
    from hpc_rlx.comm.heartbeat import HeartbeatSealer

    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rank1 = HeartbeatSealer(wd._gate.secret, 1)     # a genuine rank 1, holding the job's key
    try:
        with wd:
            wd.enter("fused-bucket Allreduce")        # rank 0 waits; rank 1 is still computing
            t0 = time.monotonic()
            while not aborted.is_set() and time.monotonic() - t0 < 10:
                beat = {"r": 1, "label": None, "step": None, "at": 4, "for": time.monotonic() - t0,
                        "seq": 2, "last": ["fused-bucket Allreduce", 3]}
                peer.sendto(rank1.seal(beat), wd._root)
                time.sleep(0.05)
            wd.leave()
    finally:
        peer.close()
    assert aborted.is_set(), out.getvalue()
    text = out.getvalue()
    assert "at step 4" in text and "not arrived (1/2): ranks 1" in text
    assert f"rank 1 on {HOST}: busy outside any collective at step 4" in text
    assert re.search(r"stalled for \d+\.\d s >= comm\.stall_abort_s=1: aborting all 2 ranks", text)
    assert 0.9 <= time.monotonic() - t0 < 5


def test_a_waiting_rank_aborts_on_its_own_when_rank_0_does_not():
    import io
    import threading

    from hpc_rlx.comm.watchdog import StallWatchdog

    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)   # a rank 0 that never answers
    sink.bind(("127.0.0.1", 0))
    out, aborted = io.StringIO(), threading.Event()
    wd = StallWatchdog(FakeComm(1, 2, root_addr=sink.getsockname()), warn_s=0.2, abort_s=0.3,
                       position=lambda: 9, out=out, abort=lambda code: aborted.set())
    try:
        with wd:
            wd.enter("error agreement (allgather)")
            assert aborted.wait(10), out.getvalue()
    finally:
        sink.close()
    assert f"rank 1 on {HOST} has waited" in out.getvalue() and "at step 9" in out.getvalue()


def test_watching_a_collective_costs_no_message_and_microseconds(monkeypatch):
    import io

    from hpc_rlx.comm import collective
    from hpc_rlx.comm import watchdog
    from hpc_rlx.comm.watchdog import StallWatchdog

    bucket = collective.FusedBucket(1000, ("samples",), np.float32, cap_mb=0.001)   # 1 KB chunks: 4 chunks
    fake = FakeComm(0, 1)
    bucket.allreduce(fake)
    unwatched = list(fake.calls)
    wd = StallWatchdog(FakeComm(0, 1), warn_s=60, position=lambda: 0, out=io.StringIO())
    with wd:
        assert watchdog.current() is wd
        fake.calls.clear()
        bucket.allreduce(fake)
        assert fake.calls == unwatched and len(unwatched) == 4    # the same MPI calls, nothing more
        n = 20000
        t0 = time.perf_counter()
        for _ in range(n):
            wd.enter("x")
            wd.leave()
        per_call = (time.perf_counter() - t0) / n
    assert watchdog.current() is not wd
    assert per_call < 20e-6, f"{per_call * 1e6:.1f} us per watched collective"
