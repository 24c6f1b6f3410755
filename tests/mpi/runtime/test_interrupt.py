"""Ctrl-C: a real `mpirun -n 2` in its own process group, interrupted the way a terminal does it
(SIGINT to the whole foreground process group), and the rank-side rules of hpc_rlx/runtime/signals.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from hpc_rlx.runtime.signals import INTERRUPT_EXIT, Signals

from tests.support.jobs import MPI_IMPL, REPO, explain, launch_cmd, mpi_env, rank_pids, train_job

LONG_RUN = ["report.plots=false", "train.epochs=5000"]
# Steps of a few seconds (sleeps, no CPU): a first Ctrl-C is still being served 1.2 s later.
# Two steps per epoch (a global batch of 512 over digits' 1438 rows); the slowdown multiplies
# the fastest step's compute (0.6-0.8 ms here), so a factor of 1000 gave steps of 0.6-0.8 s
# on a fast CPU and the first Ctrl-C was served before the test's 1.2 s; 5000 gives 3-4 s.
SLOW_STEPS = ["debug.slowdown={0: 5000, 1: 5000}", "train.batch_size=512"]
INTERRUPTED = re.compile(r"interrupted at step (\d+); checkpoint (\S+); continue with hydra\.run\.dir=(\S+)")


class LiveJob:
    """`mpirun -n N python -m hpc_rlx ...` in a new session, its output read as it comes."""

    def __init__(self, n: int, run_dir: Path, overrides: list[str], env: dict | None = None):
        cmd = launch_cmd(n, ["-m", "hpc_rlx", f"hydra.run.dir={run_dir}"] + overrides)
        self.run_dir = run_dir
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=mpi_env(env), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                         for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream, buf) -> None:
        for line in stream:
            buf.append(line)

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in list(self.out)):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.kill()
        pytest.fail(f"no {text!r} in the output within {timeout}s\n{self.explain()}")

    def ctrl_c(self) -> None:
        """What a terminal does on Ctrl-C: SIGINT to every process of the foreground group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def rank_pids(self) -> list[int]:
        """The ranks below the launcher (MPICH starts them in sessions of their own)."""
        return list(rank_pids(self.proc.pid).values())

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job did not end within {timeout}s\n{self.explain()}")
        for t in self._readers:
            t.join(timeout=10)
        return rc

    def kill(self) -> None:
        ranks = self.rank_pids()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def explain(self) -> str:
        return (f"rc={self.proc.returncode}\n--- stdout ---\n{self.stdout[-4000:]}\n"
                f"--- stderr ---\n{self.stderr[-4000:]}")


def _caught(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return int(line.split()[1], 16)
    return 0


def assert_no_traceback(job: LiveJob) -> None:
    both = job.stdout + job.stderr
    assert "Traceback" not in both and "KeyboardInterrupt" not in both, job.explain()


# ---------------------------------------------------------------------------- the rules

def test_the_first_sigint_stops_a_duplicate_is_ignored_a_later_one_exits():
    now = [100.0]
    s = Signals(clock=lambda: now[0])
    s.training_started()
    assert s.on_signal(signal.SIGINT) == "stop" and s.raised and s.interrupted
    now[0] += 0.3      # the same Ctrl-C delivered twice (terminal and launcher)
    assert s.on_signal(signal.SIGINT) == "ignore"
    now[0] += 0.8
    assert s.on_signal(signal.SIGINT) == "exit"
    assert s.exit_code == INTERRUPT_EXIT == 130


def test_sigint_before_training_exits_and_sigterm_only_stops():
    s = Signals()
    assert s.on_signal(signal.SIGINT) == "exit"
    assert "before training started" in s.exit_message()
    t = Signals()
    assert t.on_signal(signal.SIGTERM) == "stop" and t.raised and not t.interrupted
    assert t.exit_code == 0                      # preemption exits 0 after its checkpoint
    assert t.on_signal(signal.SIGUSR1) == "stop" and t.received == signal.SIGTERM
    t.stop_served()                              # a sweep's next point starts without the flag
    assert not t.raised
    s.stop_served()                              # an interrupt is never forgotten: exit 130
    assert s.raised and s.exit_code == INTERRUPT_EXIT


# ---------------------------------------------------------------------------- real jobs

@pytest.mark.mpi
@pytest.mark.openmpi
@pytest.mark.slow
def test_ctrl_c_under_mpirun_checkpoints_exits_130_and_resumes(tmp_path, digits_h5):
    run_dir = tmp_path / "run"
    job = LiveJob(2, run_dir, LONG_RUN + [f"data.path={digits_h5}"])
    job.wait_for("[hpc_rlx] epoch 1", timeout=180)       # mid-training: the first progress line
    job.ctrl_c()
    rc = job.wait(timeout=120)
    if MPI_IMPL == "openmpi":
        # prterun turns Ctrl-C into SIGTERM for the ranks and SIGKILL 0.2-0.5 s later
        # (RELIABILITY.md): no checkpoint is promised, only a quiet, failed exit
        assert rc != 0, job.explain()
        assert_no_traceback(job)
        return
    # MPICH's mpiexec forwards the SIGINT to the ranks and passes their exit status through
    assert rc == INTERRUPT_EXIT, job.explain()
    lines = [m for m in (INTERRUPTED.search(line) for line in job.out) if m]
    assert len(lines) == 1, job.explain()
    step, ckpt, where = int(lines[0].group(1)), Path(lines[0].group(2)), lines[0].group(3)
    assert where == str(run_dir) and ckpt.is_file() and ckpt.parent == run_dir / "checkpoints", job.explain()
    assert_no_traceback(job)
    # the printed command continues the run from that checkpoint
    more = train_job(2, run_dir, [f"data.path={digits_h5}", "train.epochs=5000", f"train.max_steps={step + 2}"])
    assert more.returncode == 0, explain(more)
    assert f"resumed from {ckpt}" in more.stdout, explain(more)


@pytest.mark.mpi
@pytest.mark.slow
def test_second_ctrl_c_under_mpirun_ends_the_job_at_once(tmp_path, digits_h5):
    job = LiveJob(2, tmp_path / "run", LONG_RUN + SLOW_STEPS + [f"data.path={digits_h5}"])
    job.wait_for("[hpc_rlx] epoch 1", timeout=180)
    job.ctrl_c()
    time.sleep(1.2)
    assert job.proc.poll() is None, "the first Ctrl-C was served within 1.2 s: steps too fast\n" + job.explain()
    job.ctrl_c()
    t0 = time.monotonic()
    rc = job.wait(timeout=60)
    assert time.monotonic() - t0 < 10, job.explain()
    # MPICH's mpiexec kills the ranks itself on a second Ctrl-C (they never see it) and exits
    # 255, or 0 when a proxy fails its own assertion during that cleanup: the status is then
    # MPICH's own, and its forced-cleanup lines must say so
    forced = "Ctrl-C caught... cleaning up processes" in job.stdout + job.stderr
    assert rc != 0 or (forced and "assert (!closed) failed" in job.stderr), job.explain()
    assert_no_traceback(job)


@pytest.mark.mpi
@pytest.mark.slow
def test_second_sigint_to_the_ranks_themselves_exits_at_once(tmp_path, digits_h5):
    """Where the terminal's SIGINT reaches the ranks directly (a lone `python -m hpc_rlx`, a
    launcher that keeps its ranks in the foreground group), the ranks apply the rules themselves."""
    job = LiveJob(2, tmp_path / "run", LONG_RUN + SLOW_STEPS + [f"data.path={digits_h5}"])
    job.wait_for("[hpc_rlx] epoch 1", timeout=180)
    pids = job.rank_pids()
    assert len(pids) == 2, pids

    def sigint_ranks():
        for pid in pids:
            os.kill(pid, signal.SIGINT)
    sigint_ranks()
    time.sleep(0.2)
    sigint_ranks()             # the same Ctrl-C twice: ignored
    time.sleep(1.0)
    assert job.proc.poll() is None, "a duplicate SIGINT ended the run\n" + job.explain()
    sigint_ranks()             # more than a second later: exit now
    t0 = time.monotonic()
    rc = job.wait(timeout=60)
    assert time.monotonic() - t0 < 10, job.explain()
    assert rc != 0, job.explain()
    assert job.stderr.count("hpc_rlx: interrupted again: exiting now, without a checkpoint") == 1, job.explain()
    assert_no_traceback(job)


@pytest.mark.mpi
@pytest.mark.openmpi
def test_ctrl_c_during_startup_exits_quietly(tmp_path, digits_h5):
    run_dir = tmp_path / "run"
    job = LiveJob(2, run_dir, LONG_RUN + [f"data.path={digits_h5}"])
    # hpc_rlx's handlers are in place (SIGUSR1 caught) on both ranks: still composing / loading
    usr1 = 1 << (signal.SIGUSR1 - 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pids = job.rank_pids()
        try:
            if len(pids) == 2 and all(_caught(p) & usr1 for p in pids):
                break
        except OSError:
            pass
        time.sleep(0.01)
    else:
        job.kill()
        pytest.fail("the ranks never installed their signal handlers\n" + job.explain())
    job.ctrl_c()
    rc = job.wait(timeout=60)
    assert "[hpc_rlx] epoch" not in job.stdout, "training had started: " + job.explain()
    if MPI_IMPL == "openmpi":      # the ranks get prterun's SIGTERM, then SIGKILL
        assert rc != 0, job.explain()
        assert_no_traceback(job)
        return
    assert rc == INTERRUPT_EXIT, job.explain()
    assert "hpc_rlx: interrupted before training started" in job.stderr, job.explain()
    assert_no_traceback(job)
    assert not (run_dir / "checkpoints").exists()


# Rank 0 holds at the start of a method (in Python, so its handler runs) for up to 30 s and
# says so in a file: a Ctrl-C at a chosen point of the start-up. HOLD_AT="module:Class.method".
HOLD_RANK_0_AT = """\
import os, sys, threading, time
from pathlib import Path

def _patch():
    module_name, _, attr = os.environ["HOLD_AT"].partition(":")
    cls_name, _, method = attr.partition(".")
    while module_name not in sys.modules or not hasattr(sys.modules[module_name], cls_name):
        time.sleep(0.001)
    cls = getattr(sys.modules[module_name], cls_name)
    original = getattr(cls, method)
    def held(self, *a, **k):
        Path(os.environ["HOLD_MARKER"]).write_text("holding")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.01)
        return original(self, *a, **k)
    setattr(cls, method, held)

if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "0":
    threading.Thread(target=_patch, daemon=True).start()
"""


def _job_held_at(tmp_path, run_dir, where: str, overrides: list[str]) -> LiveJob:
    """A job whose rank 0 holds at `where`; returns once it is holding there."""
    hold = tmp_path / "hold"
    hold.mkdir(exist_ok=True)
    (hold / "sitecustomize.py").write_text(HOLD_RANK_0_AT)
    marker = tmp_path / "holding"
    marker.unlink(missing_ok=True)
    job = LiveJob(2, run_dir, overrides, env={"PYTHONPATH": str(hold), "HOLD_MARKER": str(marker),
                                              "HOLD_AT": where})
    deadline = time.monotonic() + 60
    while not marker.exists():
        if time.monotonic() > deadline or job.proc.poll() is not None:
            job.kill()
            pytest.fail(f"rank 0 never reached {where}\n" + job.explain())
        time.sleep(0.02)
    return job


@pytest.mark.mpi
@pytest.mark.skipif(MPI_IMPL == "openmpi", reason="prterun answers Ctrl-C with SIGTERM/SIGKILL to the ranks")
def test_ctrl_c_before_training_leaves_no_run_directory(tmp_path, digits_h5):
    run_dir = tmp_path / "runs" / "new"
    job = _job_held_at(tmp_path, run_dir, "hpc_rlx.runtime.worker:Worker.load_data",
                       LONG_RUN + [f"data.path={digits_h5}"])
    assert run_dir.is_dir(), "Hydra creates the run directory before data loading"
    job.ctrl_c()
    rc = job.wait(timeout=60)
    assert rc == INTERRUPT_EXIT, job.explain()
    assert job.stderr.count("hpc_rlx: interrupted before training started") == 1, job.explain()
    assert_no_traceback(job)
    assert not (tmp_path / "runs").exists(), sorted(str(p) for p in (tmp_path / "runs").rglob("*"))


@pytest.mark.mpi
@pytest.mark.skipif(MPI_IMPL == "openmpi", reason="prterun answers Ctrl-C with SIGTERM/SIGKILL to the ranks")
def test_ctrl_c_while_a_resume_writes_its_segment_leaves_a_whole_segment(tmp_path, digits_h5):
    """Rank 0 has written the resumed segment's config and is about to record it in
    metrics.jsonl: a Ctrl-C there stops at the next step with a checkpoint, so the directory
    holds whole segments only."""
    run_dir = tmp_path / "run"
    first = train_job(2, run_dir, [f"data.path={digits_h5}", "train.epochs=1"], timeout=120)
    assert first.returncode == 0, explain(first)
    job = _job_held_at(tmp_path, run_dir, "hpc_rlx.observe.outputs:RunOutputs._trim_metrics",
                       ["report.plots=false", "train.epochs=50", f"data.path={digits_h5}"])
    assert (run_dir / "config.segment-2.yaml").is_file()
    job.ctrl_c()
    rc = job.wait(timeout=90)
    assert rc == INTERRUPT_EXIT, job.explain()
    assert INTERRUPTED.search(job.stdout), job.explain()
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["segment"] for e in events if e.get("event") == "segment"] == [2], events
    again = train_job(2, run_dir, [f"data.path={digits_h5}", "train.epochs=2"], timeout=120)
    assert again.returncode == 0 and "segment 3 of this run directory" in again.stdout, explain(again)


# Rank 0 holds just before MPI starts on it (the import of mpi4py.MPI) until it has been
# interrupted, or 30 s: a Ctrl-C that reaches it while the other rank is already in MPI_Init.
HOLD_RANK_0_BEFORE_MPI = """\
import os, sys, time

class _HoldBeforeMpi:
    def find_spec(self, name, path=None, target=None):
        rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
        if name == "mpi4py.MPI" and rank == "0":
            sys.meta_path.remove(self)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                signals = sys.modules.get("hpc_rlx.runtime.signals")
                if signals is not None and signals.SIGNALS.interrupted:
                    break
                time.sleep(0.01)
        return None

sys.meta_path.insert(0, _HoldBeforeMpi())
"""


@pytest.mark.mpi
@pytest.mark.openmpi
def test_ctrl_c_to_one_rank_while_mpi_starts_ends_the_job(tmp_path, digits_h5):
    """A SIGINT that only rank 0 gets, before MPI has started on it, while rank 1 waits for it
    in MPI_Init (which no Python handler can leave): the whole job still ends, exit 130."""
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(HOLD_RANK_0_BEFORE_MPI)
    job = LiveJob(2, tmp_path / "run", LONG_RUN + [f"data.path={digits_h5}"], env={"PYTHONPATH": str(hold)})
    usr1 = 1 << (signal.SIGUSR1 - 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ranks = rank_pids(job.proc.pid)
        try:
            if sorted(ranks) == [0, 1] and all(_caught(p) & usr1 for p in ranks.values()):
                break
        except OSError:
            pass
        time.sleep(0.01)
    else:
        job.kill()
        pytest.fail("the ranks never installed their signal handlers\n" + job.explain())
    os.kill(ranks[0], signal.SIGINT)
    rc = job.wait(timeout=60)
    assert rc == INTERRUPT_EXIT, job.explain()
    assert job.stderr.count("hpc_rlx: interrupted before training started") == 1, job.explain()
    assert "[hpc_rlx] epoch" not in job.stdout, job.explain()
    assert_no_traceback(job)


@pytest.mark.mpi
@pytest.mark.slow
def test_sigterm_to_one_rank_still_checkpoints_and_exits_0(tmp_path, digits_h5):
    """Preemption keeps its meaning: a checkpoint at the next step and exit status 0."""
    run_dir = tmp_path / "run"
    job = LiveJob(2, run_dir, LONG_RUN + [f"data.path={digits_h5}"])
    job.wait_for("[hpc_rlx] epoch 1", timeout=180)
    pids = job.rank_pids()
    assert len(pids) == 2, pids
    os.kill(pids[-1], signal.SIGTERM)
    rc = job.wait(timeout=120)
    assert rc == 0, job.explain()
    assert re.search(r"checkpoint \(preempt\) at step \d+", job.stdout), job.explain()
    assert not INTERRUPTED.search(job.stdout), job.explain()
    assert_no_traceback(job)
