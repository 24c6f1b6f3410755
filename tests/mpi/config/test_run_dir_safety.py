"""One training per run directory: runs started in the same second get their own directories,
a second job in a directory that is in use is refused, and `resume=none` never overwrites a
training. Real mpirun jobs; the lock is a real flock held by a real process."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpc_rlx.config.rundirs import claim_timestamp_dir
from hpc_rlx.base.errors import ConfigError
from hpc_rlx.observe.run_lock import RunDirLock
from hpc_rlx.base.run_dir_names import LOCK as LOCK_NAME

from tests.support.jobs import (PYTHON, REPO, explain, launch_cmd, mpi_env, read_metrics, train_job,
                                write_small_classification)

SMALL = ["model.hidden=[16]", "report.plots=false", "train.batch_size=64"]


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK_NAME
            and not p.name.endswith(".log")}


# ---------------------------------------------------------------------------- run ids

def test_runs_in_the_same_second_claim_different_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = "2026-01-01_00-00-00"
    got: list[str] = []
    start = threading.Barrier(8)

    def claim():
        start.wait()
        got.append(claim_timestamp_dir([], base)[0])
    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(got) == sorted([base] + [f"{base}-{k}" for k in range(1, 8)]), got
    assert all((tmp_path / "outputs" / rid).is_dir() for rid in got)


def test_a_claimed_directory_is_what_a_failed_run_removes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rid, fresh = claim_timestamp_dir([], "2026-01-01_00-00-00")
    assert fresh == (tmp_path / "outputs").absolute()        # the first run created outputs/ too
    rid2, fresh2 = claim_timestamp_dir([], "2026-01-01_00-00-00")
    assert rid2 == f"{rid}-1" and fresh2 == (tmp_path / "outputs" / rid2).absolute()
    # a named run directory and flags claim nothing
    assert claim_timestamp_dir(["hydra.run.dir=x"], "b") == ("b", (tmp_path / "x").absolute())
    assert claim_timestamp_dir(["--help"], "b") == ("b", None)
    rid3, _ = claim_timestamp_dir(["-m", "optim.lr=0.1,0.2"], "2026-01-01_00-00-00")
    assert (tmp_path / "multirun" / rid3).is_dir()


@pytest.mark.mpi
def test_two_jobs_started_at_once_write_two_directories(tmp_path, digits_h5):
    cmds = [launch_cmd(2, ["-m", "hpc_rlx", *SMALL, f"data.path={digits_h5}", "train.epochs=1", f"optim.lr={lr}"])
            for lr in (0.1, 0.05)]
    procs = [subprocess.Popen(c, cwd=tmp_path, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c in cmds]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a job did not finish in 180 s")
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    for proc in outs:
        assert proc.returncode == 0, explain(proc)
    dirs = sorted((tmp_path / "outputs").iterdir())
    assert len(dirs) == 2, dirs
    lrs = sorted(read_metrics(d)[0]["lr"] for d in dirs)
    assert [len(read_metrics(d)) for d in dirs] == [1, 1]
    assert lrs[0] < lrs[1], lrs          # one run each, not one run twice


# ---------------------------------------------------------------------------- the lock

HOLDER = """\
import sys, time
from hpc_rlx.observe.run_lock import RunDirLock
lock = RunDirLock.acquire(sys.argv[1], "node7")
print("held", flush=True)
time.sleep(60)
"""


def test_the_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    holder = subprocess.Popen([PYTHON, "-c", HOLDER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"in use by another job \(pid {holder.pid} on node7, since "):
            RunDirLock.acquire(tmp_path, "here")
    finally:
        holder.kill()
        holder.wait(10)
    # the kernel dropped the lock with the process: no stale lock
    lock = RunDirLock.acquire(tmp_path, "here")
    lock.release()
    RunDirLock.acquire(tmp_path, "here").release()


@pytest.mark.mpi
def test_a_second_job_in_a_directory_in_use_is_refused(tmp_path, digits_h5):
    run = tmp_path / "run"
    first = subprocess.Popen(launch_cmd(2, ["-m", "hpc_rlx", *SMALL, f"data.path={digits_h5}", f"hydra.run.dir={run}",
                                            "train.epochs=5000", "checkpoint.every_epochs=1"]),
                             cwd=REPO, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() or not read_metrics(run):
            assert first.poll() is None and time.monotonic() < deadline, "the first job did not train"
            time.sleep(0.2)
        second = train_job(2, run, [*SMALL, f"data.path={digits_h5}", "train.epochs=1"], timeout=120)
        assert second.returncode == 2, explain(second)
        errors = [ln for ln in second.stderr.splitlines() if ln.startswith("hpc_rlx: error")]
        assert len(errors) == 1 and f"run directory {run} is in use by another job (pid " in errors[0], explain(second)
        assert "[hpc_rlx] epoch" not in second.stdout, explain(second)
        assert not list(run.glob("config.segment-*.yaml")), "the second job started a segment"
        assert first.poll() is None, "the first job was disturbed"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
    # once the first job is gone the directory is free: the next job continues it
    third = train_job(2, run, [*SMALL, f"data.path={digits_h5}", "train.epochs=5000", "train.max_steps=1"],
                      timeout=120)
    assert third.returncode == 0 and "resumed from" in third.stdout, explain(third)


# ---------------------------------------------------------------------------- resume=none

@pytest.mark.mpi
def test_resume_none_is_refused_where_a_training_is(tmp_path, digits_h5):
    run = tmp_path / "run"
    a = train_job(2, run, [*SMALL, f"data.path={digits_h5}", "train.epochs=1"], timeout=120)
    assert a.returncode == 0, explain(a)
    before = _digest(run)
    assert "checkpoints/latest" in before and "model.h5" in before
    log = (run / "hpc_rlx.log").read_text().splitlines()     # what rank 0 printed, timestamped
    assert any(re.fullmatch(r"\[[-0-9 :]+\] \[hpc_rlx\] epoch 1/1  train_loss .*", ln) for ln in log), log
    assert "[hpc_rlx] completed in" in log[-1], log
    b = train_job(2, run, ["model=cnn", "report.plots=false", f"data.path={digits_h5}", "train.epochs=1",
                           "resume=none", "checkpoint.every_epochs=1"], timeout=120)
    assert b.returncode == 2, explain(b)
    errors = [ln for ln in b.stderr.splitlines() if ln.startswith("hpc_rlx: error")]
    assert len(errors) == 1, explain(b)
    assert "resume=none starts over" in errors[0] and "hydra.run.dir" in errors[0], explain(b)
    assert errors[0] in (run / "hpc_rlx.log").read_text().splitlines()[-1]
    assert _digest(run) == before, "the first training's files changed"
    # the advice works: a new directory trains from scratch
    c = train_job(2, tmp_path / "new", ["model=cnn", "report.plots=false", f"data.path={digits_h5}",
                                        "train.epochs=1", "resume=none"], timeout=120)
    assert c.returncode == 0, explain(c)


# ---------------------------------------------------------------------------- another model

@pytest.mark.mpi
def test_another_model_in_a_run_directory_without_checkpoints_is_refused(tmp_path):
    """checkpoint=off leaves no checkpoint to compare, but graph.json says which model the
    directory's model.h5, config.yaml and metrics belong to: another graph is refused with the
    checkpoint case's message, the same graph is a new segment."""
    data = write_small_classification(tmp_path / "wine.h5", rows=96, seed=3)
    run = tmp_path / "run"
    base = ["model=mlp", "data=file", f"data.path={data}", "model.num_classes=3", "train.epochs=1",
            "checkpoint=off", "train.batch_size=32"]
    a = train_job(2, run, base + ["model.hidden=[16]"], timeout=120)
    assert a.returncode == 0, explain(a)
    before = _digest(run)
    assert "model.h5" in before and "graph.json" in before
    b = train_job(2, run, base + ["model.hidden=[32]"], timeout=120)
    assert b.returncode == 2, explain(b)
    errors = [ln for ln in b.stderr.splitlines() if ln.startswith("hpc_rlx: error")]
    assert len(errors) == 1 and "Traceback" not in b.stderr, explain(b)
    assert f"run directory {run} was written for a different model graph (graph.json graph " in errors[0]
    assert "hydra.run.dir=" in errors[0], errors[0]
    assert _digest(run) == before, "the first model's files changed"
    # the same model again: a new segment of the directory, as before
    c = train_job(2, run, base + ["model.hidden=[16]"], timeout=120)
    assert c.returncode == 0, explain(c)
    assert (run / "config.segment-2.yaml").is_file(), explain(c)
    assert _digest(run)["config.yaml"] == before["config.yaml"]
    events = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e.get("segment") for e in events if e.get("event") == "segment"] == [2], events
