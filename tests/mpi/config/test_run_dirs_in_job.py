"""Runs inside one Slurm job (several mpirun runs in one allocation or batch script): only the
same training continues a directory; every segment keeps its config and is marked in
metrics.jsonl. Real mpirun jobs; the job is named by SLURM_JOB_ID in the ranks' environment
(the real cluster runs the same rule through slurm/train.sh in test_slurm.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.jobs import explain, launch_cmd, mpi_env, mpirun, read_metric_events, read_metrics

pytestmark = pytest.mark.mpi

JOB = "4242"
SMALL = ["model.hidden=[16]", "report.plots=false", "train.batch_size=64"]


def job_run(n: int, cwd: Path, overrides: list[str], timeout: float = 180, **slurm) -> subprocess.CompletedProcess:
    """`mpirun -n N python -m hpc_rlx` in `cwd`, every rank seeing SLURM_JOB_ID (and `slurm`)."""
    rank_env = {"SLURM_JOB_ID": JOB, **{f"SLURM_{k.upper()}": v for k, v in slurm.items()}}
    cmd = launch_cmd(n, ["-m", "hpc_rlx", *SMALL, *overrides], rank_env=rank_env)
    try:
        return subprocess.run(cmd, cwd=cwd, env=mpi_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s: {e}")


def config(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.mark.slow
def test_runs_of_one_slurm_job_continue_only_the_same_training(tmp_path, digits_h5):
    data = f"data.path={digits_h5}"
    outputs = tmp_path / "outputs"
    first, second = outputs / f"slurm-{JOB}", outputs / f"slurm-{JOB}.1"

    a = job_run(2, tmp_path, [data, "optim.lr=0.1", "train.epochs=2"])
    assert a.returncode == 0, explain(a)
    assert sorted(p.name for p in outputs.iterdir()) == [first.name]

    # another learning rate in the same job: a fresh directory, nothing resumed
    b = job_run(2, tmp_path, [data, "optim.lr=0.05", "train.epochs=2"])
    assert b.returncode == 0, explain(b)
    assert "resumed from" not in b.stdout, explain(b)
    assert sorted(p.name for p in outputs.iterdir()) == [first.name, second.name]
    assert config(first / "config.yaml")["optim"]["lr"] == 0.1, "the first run's record is intact"
    assert config(second / "config.yaml")["optim"]["lr"] == 0.05
    assert [m["epoch"] for m in read_metrics(second)] == [1, 2]

    # the first config again, longer and on another number of ranks: it continues the first run
    c = job_run(1, tmp_path, [data, "optim.lr=0.1", "train.epochs=3"])
    assert c.returncode == 0, explain(c)
    assert f"resumed from {first}/checkpoints/ckpt-" in c.stdout, explain(c)
    assert sorted(p.name for p in outputs.iterdir()) == [first.name, second.name]
    assert [m["epoch"] for m in read_metrics(first)] == [1, 2, 3]
    assert config(first / "config.yaml")["train"]["epochs"] == 2, "config.yaml is never overwritten"
    assert config(first / "config.segment-2.yaml")["train"]["epochs"] == 3
    events = [r for r in read_metric_events(first) if r.get("event") == "segment"]
    assert len(events) == 1, read_metric_events(first)
    seg = events[0]
    assert seg["segment"] == 2 and seg["config"] == "config.segment-2.yaml"
    assert seg["start_epoch"] == 2 and seg["start_step"] == read_metrics(first)[1]["step"]
    assert seg["world_size"] == 1 and seg["resumed_from"]
    assert seg["changed"] == {"train.epochs": [2, 3]}
    # the segment marker sits between the epochs of the two segments
    order = [r.get("epoch", "segment") for r in read_metric_events(first)]
    assert order == [1, 2, "segment", 3], order
    assert "segment 2 of this run directory" in c.stdout and "train.epochs 2 -> 3" in c.stdout

    # the directory asked for by name continues whatever config comes with it, and says so
    d = job_run(2, tmp_path, [data, "optim.lr=0.2", "train.epochs=3", f"hydra.run.dir={second}"])
    assert d.returncode == 0, explain(d)
    assert "resumed from" in d.stdout, explain(d)
    (seg,) = [r for r in read_metric_events(second) if r.get("event") == "segment"]
    assert seg["changed"] == {"optim.lr": [0.05, 0.2], "train.epochs": [2, 3]}
    assert config(second / "config.yaml")["optim"]["lr"] == 0.05
    assert config(second / "config.segment-2.yaml")["optim"]["lr"] == 0.2


def test_resume_none_in_a_job_gets_a_fresh_directory(tmp_path, digits_h5):
    data = f"data.path={digits_h5}"
    a = job_run(2, tmp_path, [data, "train.epochs=1"])
    assert a.returncode == 0, explain(a)
    b = job_run(2, tmp_path, [data, "train.epochs=1", "resume=none"])
    assert b.returncode == 0, explain(b)
    names = sorted(p.name for p in (tmp_path / "outputs").iterdir())
    assert names == [f"slurm-{JOB}", f"slurm-{JOB}.1"], names
    for name in names:
        assert [m["epoch"] for m in read_metrics(tmp_path / "outputs" / name)] == [1]


# ---------------------------------------------------------------------------- failed runs, debug log

def test_a_run_that_fails_before_training_leaves_no_directory(tmp_path, digits_h5):
    missing = ["data=file", f"data.path={tmp_path / 'missing.h5'}"]
    proc = mpirun(2, ["-m", "hpc_rlx", *SMALL, *missing], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert not (tmp_path / "outputs").exists(), sorted(str(p) for p in (tmp_path / "outputs").rglob("*"))

    # an unexpected failure on rank 1 while loading data (the job is aborted), into a named dir
    named = tmp_path / "runs" / "named"
    proc = mpirun(2, ["-m", "hpc_rlx", *SMALL, f"data.path={digits_h5}", f"hydra.run.dir={named}",
                      "debug.fail_rank=1", "debug.fail_point=data"], cwd=tmp_path, timeout=120)
    assert proc.returncode != 0 and "injected failure" in proc.stderr, explain(proc)
    assert not (tmp_path / "runs").exists(), sorted(str(p) for p in (tmp_path / "runs").rglob("*"))

    # a directory that was there before is the user's: it stays, with what was in it
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    proc = mpirun(2, ["-m", "hpc_rlx", *SMALL, *missing, f"hydra.run.dir={kept}"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert (kept / "notes.txt").read_text() == "mine"

    # a run that trained keeps its directory even when it fails later
    late = tmp_path / "late"
    proc = mpirun(2, ["-m", "hpc_rlx", *SMALL, f"data.path={digits_h5}", f"hydra.run.dir={late}",
                      "train.epochs=2", "debug.fail_rank=1", "debug.fail_point=step", "debug.fail_step=30"],
                  cwd=tmp_path, timeout=120)
    assert proc.returncode != 0, explain(proc)
    assert (late / "config.yaml").is_file() and (late / "metrics.jsonl").is_file()


# Rank 1 imports hydra (and so reaches the point where Hydra creates the run directory on it)
# seconds after the others: how a busy machine schedules it.
LATE_RANK_1 = """\
import os, sys, time

class _LateHydra:
    def find_spec(self, name, path=None, target=None):
        rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
        if name == "hydra" and rank == "1":
            sys.meta_path.remove(self)
            time.sleep(3)
        return None

sys.meta_path.insert(0, _LateHydra())
"""


def test_a_run_that_fails_before_training_leaves_no_directory_when_a_rank_is_late(tmp_path):
    """Rank 0 finds the data missing and broadcasts the error while rank 1 has not yet started
    its Hydra job (which creates the run directory on every rank): the directory is removed
    only once rank 1 is past that point."""
    late = tmp_path / "late"
    late.mkdir()
    (late / "sitecustomize.py").write_text(LATE_RANK_1)
    missing = ["data=file", f"data.path={tmp_path / 'missing.h5'}"]
    proc = mpirun(2, ["-m", "hpc_rlx", *SMALL, *missing], cwd=tmp_path, timeout=120,
                  env={"PYTHONPATH": str(late)})
    assert proc.returncode == 2, explain(proc)
    assert "dataset file" in proc.stderr and "does not exist" in proc.stderr, explain(proc)
    assert not (tmp_path / "outputs").exists(), sorted(str(p) for p in (tmp_path / "outputs").rglob("*"))


def test_hydra_verbose_turns_on_hpc_rlx_debug_log(tmp_path, digits_h5):
    proc = mpirun(2, ["-m", "hpc_rlx", "model.hidden=[16]", "train.epochs=2", f"data.path={digits_h5}",
                      f"hydra.run.dir={tmp_path / 'run'}", "report.plots=true", "hydra.verbose=true"],
                  cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, explain(proc)
    debug = [line for line in proc.stdout.splitlines() if "][DEBUG] - " in line]
    ours = [line for line in debug if "][hpc_rlx" in line]
    assert any("][hpc_rlx][DEBUG] - spec: run_dir=" in line and "config_fingerprint=cfg-" in line
               for line in ours), debug[:20]
    assert any("][hpc_rlx.checkpoint.runtime][DEBUG] - resume=auto" in line for line in ours), ours
    assert any("best val_loss so far at step" in line for line in ours), ours
    # libraries that flood DEBUG stay quiet unless named
    assert not [line for line in debug if "][matplotlib" in line or "][h5py" in line], debug[:20]
    assert (tmp_path / "run" / "plots").is_dir(), "matplotlib did run"


def _strip_fingerprints(run_dir: Path) -> None:
    """Rewrite the run's checkpoints as hpc_rlx wrote them before fingerprints were recorded
    (same format, no `config_fingerprint` in the meta)."""
    from hpc_rlx.checkpoint import CheckpointManager, read_checkpoint

    directory = run_dir / "checkpoints"
    for path in sorted(directory.glob("ckpt-*.h5")):
        state = read_checkpoint(path)
        state.meta.pop("config_fingerprint", None)
        CheckpointManager(directory, keep_last=10).save(state, step=state.step)
        assert "config_fingerprint" not in read_checkpoint(path).meta


@pytest.mark.slow
def test_a_checkpoint_from_before_fingerprints_resumes_when_requeued_or_named(tmp_path, digits_h5):
    data = f"data.path={digits_h5}"
    first = tmp_path / "outputs" / f"slurm-{JOB}"
    a = job_run(2, tmp_path, [data, "train.epochs=1"])
    assert a.returncode == 0, explain(a)
    _strip_fingerprints(first)

    # nothing proves it is the same training: a run that is not a requeue starts fresh
    b = job_run(2, tmp_path, [data, "train.epochs=2"])
    assert b.returncode == 0 and "resumed from" not in b.stdout, explain(b)
    assert (tmp_path / "outputs" / f"slurm-{JOB}.1").is_dir()
    # a requeued job continues its newest directory when that cannot be told apart: make the
    # old directory the newest again
    shutil.rmtree(tmp_path / "outputs" / f"slurm-{JOB}.1")
    c = job_run(2, tmp_path, [data, "train.epochs=2"], restart_count=1)
    assert c.returncode == 0, explain(c)
    assert f"resumed from {first}/checkpoints/ckpt-" in c.stdout, explain(c)
    assert [m["epoch"] for m in read_metrics(first)] == [1, 2]
    # ... and a directory named explicitly resumes whatever wrote it
    _strip_fingerprints(first)
    d = job_run(2, tmp_path, [data, "train.epochs=3", f"hydra.run.dir={first}"])
    assert d.returncode == 0 and f"resumed from {first}/checkpoints/ckpt-" in d.stdout, explain(d)
    assert [m["epoch"] for m in read_metrics(first)] == [1, 2, 3]
