"""Checkpoints of pipelined runs (``parallel.pipeline_stages`` S > 1) under real mpirun: the file
is the data-parallel one (rank 0 writes it one stage at a time), and it resumes on another layout
(S = 1, S = 2 with D = 2, S = 4) to end within 1e-10 (float64, policy sync) of the straight
1-rank run; a 1-rank checkpoint resumes on S = 2; a SIGTERM to one rank of a pipelined run writes
a preemption checkpoint that resume=auto continues to the same end."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpc_rlx.checkpoint import read_checkpoint

from hpc_rlx.checkpoint import verify_checkpoint

from tests.support.jobs import explain, mpirun, train_job
from tests.mpi.checkpoint.test_resume import LIMITED
from tests.mpi.runtime.test_interrupt import LiveJob, assert_no_traceback

# the module's fixture runs its jobs once: its tests keep to one pytest-xdist worker
pytestmark = [pytest.mark.mpi, pytest.mark.xdist_group("pipelined-checkpoints")]

BASE = ["train.dtype=float64", "train.epochs=2", "train.batch_size=24", "data.leftover=partial",
        "model.hidden=[32,16]", "optim.lr=0.05", "optim.momentum=0.9"]
STOP = ["train.max_steps=7", "checkpoint.every_steps=3"]     # 60 steps/epoch: stops mid-epoch 1
# split by parameter count: the same stages every run (the held bytes below depend on them)
PIPE2 = ["parallel.pipeline_stages=2", "parallel.microbatches=4", "parallel.balance=params"]
HELD = re.compile(r"checkpoint \(\w+\) at step (\d+): \S+ \[[\d.]+s, stages received one at a time: "
                  r"at most (\d+) bytes held\]")


def model(run_dir: Path) -> dict:
    with h5py.File(run_dir / "model.h5", "r") as f:
        return {k: f[k][...] for k in f.keys()}


def assert_close(ref: dict, got: dict, tol: float = 1e-10) -> None:
    assert ref.keys() == got.keys()
    for k in ref:
        rel = float(np.abs(ref[k] - got[k]).max()) / max(float(np.abs(ref[k]).max()), 1e-300)
        assert rel <= tol, (k, rel)


def latest(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, digits_h5):
    """The straight 1-rank run (to its end, and stopped at step 7), and S = 2 stopped at step 7."""
    root = tmp_path_factory.mktemp("pipe_ckpt")
    data = [f"data.path={digits_h5}"]
    out = {}
    for name, n, overrides in (("ref", 1, BASE), ("ref7", 1, BASE + STOP), ("pipe7", 2, BASE + STOP + PIPE2)):
        proc = train_job(n, root / name, overrides + data)
        assert proc.returncode == 0, explain(proc)
        out[name] = root / name
        out[name + "_log"] = proc.stdout
    return out


def resume(runs, source: str, dest: Path, n: int, overrides: list[str], digits_h5) -> None:
    shutil.copytree(runs[source], dest)
    proc = train_job(n, dest, BASE + overrides + [f"data.path={digits_h5}", "resume=auto"])
    assert proc.returncode == 0, explain(proc)
    assert "resumed from" in proc.stdout and "global step 7" in proc.stdout, explain(proc)
    assert_close(model(runs["ref"]), model(dest))


def test_a_pipelined_checkpoint_is_the_data_parallel_file(runs, tmp_path):
    """read_checkpoint verifies it; its arrays are the straight run's at that step (the whole
    model, in the whole graph's order); only rank 0's log reports what it held."""
    pipe, ref = read_checkpoint(latest(runs["pipe7"])), read_checkpoint(latest(runs["ref7"]))
    assert pipe.step == ref.step == 7
    assert list(pipe.arrays) == list(ref.arrays) == ["params", "opt/momentum_buffer"]
    for k in ref.arrays:
        assert pipe.arrays[k].shape == ref.arrays[k].shape and pipe.arrays[k].dtype == ref.arrays[k].dtype
        rel = float(np.abs(pipe.arrays[k] - ref.arrays[k]).max()) / float(np.abs(ref.arrays[k]).max())
        assert rel <= 1e-10, (k, rel)
    for key in ("graph_fingerprint", "step", "epoch", "step_in_epoch", "plan", "optimizer"):
        assert pipe.meta[key] == ref.meta[key], key
    assert pipe.meta["world_size"] == 2 and pipe.meta["shard_positions"]["per_rank"] == [7, 7]
    # rank 0 (stage 0) received stage 1 alone: its parameters and momentum, not the model's
    held = {int(s): int(b) for s, b in HELD.findall(runs["pipe7_log"])}
    assert sorted(held) == [3, 6, 7], runs["pipe7_log"]
    whole = ref.arrays["params"].nbytes + ref.arrays["opt/momentum_buffer"].nbytes
    stage1 = 2 * 8 * (32 * 16 + 16 + 16 * 10 + 10)   # stage 1: the last two layers, params + momentum
    assert set(held.values()) == {stage1} and stage1 < whole / 3
    # the exporter reads it as any checkpoint
    out = tmp_path / "pipe7.safetensors"
    proc = subprocess.run([sys.executable, "-m", "hpc_rlx.export", str(runs["pipe7"]), "--checkpoint", "latest",
                           "--state-dict", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and out.is_file(), explain(proc)


def test_pipelined_checkpoint_resumes_on_one_rank(runs, tmp_path, digits_h5):
    resume(runs, "pipe7", tmp_path / "s1", 1, [], digits_h5)


def test_pipelined_checkpoint_resumes_on_two_stages_two_replicas(runs, tmp_path, digits_h5):
    resume(runs, "pipe7", tmp_path / "s2d2", 4, PIPE2, digits_h5)


@pytest.mark.slow
def test_pipelined_checkpoint_resumes_on_four_stages(runs, tmp_path, digits_h5):
    resume(runs, "pipe7", tmp_path / "s4", 4, ["parallel.pipeline_stages=4", "parallel.microbatches=4"],
           digits_h5)


def test_one_rank_checkpoint_resumes_on_two_stages(runs, tmp_path, digits_h5):
    resume(runs, "ref7", tmp_path / "from1", 2, PIPE2, digits_h5)


def test_a_checkpoint_of_another_model_is_refused_on_every_rank(runs, tmp_path, digits_h5):
    run = tmp_path / "other"
    shutil.copytree(runs["pipe7"], run)
    proc = train_job(2, run, BASE + PIPE2 + ["model.hidden=[32,8]", f"data.path={digits_h5}", "resume=auto"],
                     timeout=60)
    assert proc.returncode != 0
    assert "different model graph" in proc.stderr, explain(proc)
    assert proc.stderr.count("hpc_rlx: error") == 1, explain(proc)


def test_a_failing_write_of_a_pipelined_save_keeps_the_previous_checkpoint(runs, tmp_path, digits_h5):
    """A full disk (RLIMIT_FSIZE) while rank 0 writes the stages: one clear error on every
    rank, no hang (stage 1 is still received), the previous checkpoint and `latest` untouched."""
    run = tmp_path / "full"
    shutil.copytree(runs["pipe7"], run)
    previous = latest(run)
    before = previous.read_bytes()
    args = ["-c", LIMITED.format(previous.stat().st_size // 2), f"hydra.run.dir={run}", "report.plots=false",
            "resume=auto", "train.max_steps=10", "checkpoint.every_steps=3", f"data.path={digits_h5}"] + BASE + PIPE2
    proc = mpirun(2, args, timeout=90)
    assert proc.returncode == 2, explain(proc)
    assert "could not write checkpoint" in proc.stderr and "disk full" in proc.stderr, explain(proc)
    assert proc.stderr.count("hpc_rlx: error") == 1, explain(proc)
    assert previous.read_bytes() == before and latest(run) == previous
    verify_checkpoint(previous)
    assert not [p.name for p in (run / "checkpoints").iterdir() if ".tmp-" in p.name]


@pytest.mark.slow
def test_sigterm_to_one_stage_checkpoints_and_resume_auto_ends_the_same(runs, tmp_path, digits_h5):
    """Preemption of a pipelined run: SIGTERM to the last stage's rank; every rank stops at the
    same step with a checkpoint, exits 0, and resume=auto ends where the straight run ends."""
    run = tmp_path / "preempted"
    slow = ["debug.slowdown={0: 50, 1: 50}", "report.plots=false"]
    job = LiveJob(2, run, BASE + PIPE2 + slow + [f"data.path={digits_h5}"])
    job.wait_for("[hpc_rlx] epoch 1", timeout=180)
    pids = job.rank_pids()
    assert len(pids) == 2, pids
    os.kill(pids[-1], signal.SIGTERM)
    rc = job.wait(timeout=120)
    assert rc == 0, job.explain()
    m = re.search(r"checkpoint \(preempt\) at step (\d+)", job.stdout)
    assert m and 0 < int(m.group(1)) < 120, job.explain()
    assert_no_traceback(job)
    read_checkpoint(latest(run))
    proc = train_job(2, run, BASE + PIPE2 + [f"data.path={digits_h5}", "resume=auto"])
    assert proc.returncode == 0, explain(proc)
    assert f"global step {m.group(1)}" in proc.stdout, explain(proc)
    assert_close(model(runs["ref"]), model(run))
