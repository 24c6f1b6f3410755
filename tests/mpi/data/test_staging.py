"""`data.stage_dir`: real `mpirun -n 2` jobs over a directory of one-sample HDF5 files, staged
to a directory of their own. A staged run trains bitwise like an unstaged one, reads the
copies, removes them at its end (kept with `data.stage_keep=true`), stages again on a resume
on another world size; a stage directory that is not writable or too small is one error."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpc_rlx.data.stage_plan import staged_name
from tests.support.jobs import (MPI_IMPL, REPO, explain, launch_cmd, launch_prefix, mpi_env, read_log,
                                read_metrics, train_job, with_read_only)
from tests.support.jobs import _need_mount_namespace
from tests.support.mpi_launch import PYTHON

FILES = 70      # 56 training samples (batch 16: 3 full steps, 8 leftover), 14 validation
COMMON = ["data=file", "data.one_sample_per_file=true", "model.num_classes=3", "model.hidden=[8]",
          "train.batch_size=16", "train.epochs=2", "train.dtype=float64", "data.leftover=partial",
          "report.tensorboard=false"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A directory of one-sample files: x (6,) float32, y a class in [0, 3)."""
    root = tmp_path_factory.mktemp("staging") / "samples"
    root.mkdir()
    rng = np.random.default_rng(7)
    for i in range(FILES):
        with h5py.File(root / f"s_{i:03d}.h5", "w") as f:
            f["x"] = rng.standard_normal(6).astype(np.float32)
            f["y"] = np.int64(rng.integers(0, 3))
    return root


def model(run: Path) -> dict:
    with h5py.File(run / "model.h5", "r") as f:
        return {k: f[k][...] for k in f}


def losses(run: Path) -> list:
    return [(r["train_loss"], r["val_loss"]) for r in read_metrics(run)]


def test_a_staged_run_trains_bitwise_like_an_unstaged_one_and_removes_its_copies(tmp_path, files):
    plain, staged, stage = tmp_path / "plain", tmp_path / "staged", tmp_path / "stage"
    common = [*COMMON, f"data.path={files}"]
    proc = train_job(2, plain, common)
    assert proc.returncode == 0, explain(proc)
    proc = train_job(2, staged, [*common, f"data.stage_dir={stage}"])
    assert proc.returncode == 0, explain(proc)
    log = read_log(staged)
    assert re.search(rf"staged {FILES} file\(s\), [\d.]+ KiB, to data.stage_dir={stage} on 1 node\(s\) in "
                     r"[\d.]+ s", log), log
    # every rank read its files from the node's copies, none in place: rows of 4 and 3 samples,
    # rank 0 the 8 rows of 4, and 7 validation files each
    summary = json.loads((staged / "summary.json").read_text())
    assert [(r["staged_reads"], r["in_place_reads"]) for r in summary["ranks"]] == [(39, 0), (31, 0)], summary
    want, got = model(plain), model(staged)
    assert sorted(want) == sorted(got)
    for k in want:
        assert np.array_equal(want[k], got[k]), k
    assert losses(staged) == losses(plain)
    assert list(stage.iterdir()) == [], list(stage.iterdir())       # removed at the end

    # a resume on another world size stages again; data.stage_keep leaves the copies
    proc = train_job(1, staged, [*common, f"data.stage_dir={stage}", "data.stage_keep=true", "train.epochs=3"])
    assert proc.returncode == 0, explain(proc)
    assert len(re.findall(r"staged \d+ file\(s\)", read_log(staged))) == 2, read_log(staged)
    assert [r["epoch"] for r in read_metrics(staged)] == [1, 2, 3]
    (kept,) = stage.glob("hpc_rlx-stage-*")
    assert sorted(p.name for p in kept.iterdir()) == sorted(staged_name(str(p)) for p in files.iterdir())


def test_with_scatter_only_rank_0_stages_and_reads_and_the_run_equals_an_unstaged_one(tmp_path, files):
    plain, staged, stage = tmp_path / "plain", tmp_path / "staged", tmp_path / "stage"
    common = [*COMMON, f"data.path={files}", "data.distribution=scatter"]
    proc = train_job(2, plain, common)
    assert proc.returncode == 0, explain(proc)
    proc = train_job(2, staged, [*common, f"data.stage_dir={stage}"])
    assert proc.returncode == 0, explain(proc)
    assert re.search(rf"staged {FILES} file\(s\), [\d.]+ KiB, to data.stage_dir={stage} on 1 node\(s\)",
                     read_log(staged)), read_log(staged)
    # rank 0 read every training and validation file from its copies, rank 1 none at all
    summary = json.loads((staged / "summary.json").read_text())
    assert [(r["staged_reads"], r["in_place_reads"]) for r in summary["ranks"]] == [(FILES, 0), (0, 0)], summary
    want, got = model(plain), model(staged)
    assert sorted(want) == sorted(got) and all(np.array_equal(want[k], got[k]) for k in want)
    assert losses(staged) == losses(plain)
    assert list(stage.iterdir()) == []


def _small_tmpfs(mount: Path, size: str, cmd: list[str]) -> list[str]:
    """`cmd` in its own mount namespace with a tmpfs of `size` at `mount` (nothing leaks out)."""
    _need_mount_namespace("a small filesystem needs root and unshare(1)")
    return ["unshare", "-m", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs -o size="$1" tmpfs "$0" && shift && exec "$@"', str(mount), size] + cmd


@pytest.mark.parametrize("case", ["read_only", "too_small", "fails_after_staging"])
def test_a_stage_dir_that_is_not_writable_or_too_small_is_one_error(tmp_path, files, case):
    """... and a run that fails once its files are staged (labels outside model.num_classes=2,
    found as the shards are read) removes its copies."""
    place = tmp_path / "place"
    place.mkdir()
    stage = place / "stage"
    args = ["-m", "hpc_rlx", f"hydra.run.dir={tmp_path / 'run'}", "report.plots=false", *COMMON,
            f"data.path={files}", f"data.stage_dir={stage}"]
    if case == "fails_after_staging":
        args.append("model.num_classes=2")
    cmd = launch_cmd(2, args)
    cmd = (with_read_only(place, cmd) if case == "read_only" else _small_tmpfs(place, "64k", cmd)
           if case == "too_small" else cmd)
    proc = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, explain(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpc_rlx: error")]
    assert len(errors) == 1, explain(proc)     # agreed: printed once, by rank 0
    if case == "read_only":
        assert f"data.stage_dir={stage} is not writable" in errors[0], errors
    elif case == "fails_after_staging":
        assert "label" in errors[0] and stage.is_dir(), errors      # staged, then failed
    else:
        assert re.search(rf"data.stage_dir={stage} on \S+ has 64.0 KiB free, but this node's {FILES} "
                         r"file\(s\) to stage take [\d.]+ KiB", errors[0]), errors
    assert "Traceback" not in proc.stderr, explain(proc)
    assert not stage.exists() or list(stage.iterdir()) == []      # nothing copied, nothing left


def _ulfm(n: int, run: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    """`mpirun --with-ft ulfm -n N python -m hpc_rlx ...` (Open MPI 5: comm.on_failure=shrink)."""
    prefix = launch_prefix(n)
    cmd = prefix[:1] + ["--with-ft", "ulfm"] + prefix[1:] + [PYTHON, "-m", "hpc_rlx", f"hydra.run.dir={run}",
                                                            "report.plots=false", *overrides]
    try:
        return subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"no exit within 120 s: {' '.join(cmd)}\n{e.stdout}\n{e.stderr}")


@pytest.mark.openmpi
@pytest.mark.skipif(MPI_IMPL != "openmpi", reason="ULFM: Open MPI 5's mpirun --with-ft ulfm")
def test_after_a_dead_rank_the_survivors_read_their_new_shards_staged(tmp_path, files):
    """comm.on_failure=shrink: rank 1 of 3 killed at step 3; the survivors re-plan over 2 ranks
    and read their new shards (the node staged every rank's files, so from its copies), ending
    as the same shrink without staging; the copies go at the end."""
    stage = tmp_path / "stage"
    common = [*COMMON, f"data.path={files}", "comm.on_failure=shrink", "comm.shared_memory=false",
              "debug.fail_rank=[1]", "debug.fail_point=step", "debug.fail_step=3", "debug.fail_mode=kill"]
    plain = _ulfm(3, tmp_path / "plain", common)
    assert plain.returncode == 0, explain(plain)
    staged = _ulfm(3, tmp_path / "staged", [*common, f"data.stage_dir={stage}"])
    assert staged.returncode == 0, explain(staged)
    summary = json.loads((tmp_path / "staged" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2, summary
    assert [f["ranks"] for f in summary["failures"]] == [[1]], summary
    # the new shards: 56 training samples over 2 ranks (rows 0-7 of 4, rows 8-15 of 3), 7 validation each
    assert [(r["staged_reads"], r["in_place_reads"]) for r in summary["ranks"]] == [(39, 0), (31, 0)], summary
    want, got = model(tmp_path / "plain"), model(tmp_path / "staged")
    for k in want:
        assert np.array_equal(want[k], got[k]), k
    assert losses(tmp_path / "staged") == losses(tmp_path / "plain")
    assert list(stage.iterdir()) == [], list(stage.iterdir())
