"""Helpers for tests that run real jobs: `mpirun -n N python ...` as a subprocess, always with a
timeout (a hang fails the calling test, not the run), and readers of what a run wrote."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from hpc_rlx.comm.waiting import SLEEPY_WAIT

from tests.support import mpi_launch
# HPC_RLX_MPI=mpich|openmpi picks the MPI; launch_cmd writes its launcher flags
from tests.support.mpi_launch import MPI_IMPL, MPIRUN, PYTHON, launch_cmd, launch_prefix, rank_pids  # noqa: F401 - re-exported

REPO = Path(__file__).resolve().parents[2]


def mpi_env(extra: dict | None = None) -> dict:
    """The environment of a test job: this one, one BLAS thread, plus `extra` (a None value
    removes the variable)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["HYDRA_FULL_ERROR"] = "0"
    if not _running_a_timing_test():
        # The suite runs four jobs at once on two cores: their waiting ranks sleep between MPI
        # polls, as hpc_rlx arranges by itself for one job with more ranks than cores
        # (hpc_rlx/comm/waiting.py). A `timing` test runs alone, with MPI's own waiting.
        for key, value in SLEEPY_WAIT.items():
            env.setdefault(key, value)
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _running_a_timing_test() -> bool:
    item = mpi_launch.RUNNING_TEST
    return item is not None and item.get_closest_marker("timing") is not None


def mpirun(n: int, args: list[str], timeout: float = 120, cwd: str | Path | None = None,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `mpirun -n N python ARGS`; a hang fails the calling test (TimeoutExpired), not CI."""
    cmd = launch_cmd(n, list(args))
    try:
        return subprocess.run(cmd, cwd=cwd or REPO, env=mpi_env(env), capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"mpirun -n {n} {' '.join(args)} did not finish in {timeout}s\n"
                    f"--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-3000:]}")


def train_job(n: int, run_dir: Path, overrides: list[str], timeout: float = 180,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """`mpirun -n N python -m hpc_rlx hydra.run.dir=RUN_DIR OVERRIDES`."""
    return mpirun(n, ["-m", "hpc_rlx", f"hydra.run.dir={run_dir}", "report.plots=false"] + overrides,
                  timeout=timeout, env=env)


def with_private_dev_shm(size: str, cmd: list[str]) -> list[str]:
    """``cmd`` in its own mount namespace over a real tmpfs of ``size`` on /dev/shm: what a
    container's small /dev/shm looks like to MPI and to hpc_rlx. Skips the test where that
    cannot be made (not root, no unshare); with HPC_RLX_REQUIRE_NETNS=1 (CI) it fails instead."""
    _need_mount_namespace("a private /dev/shm needs root and unshare(1)")
    return ["unshare", "-m", "--propagation", "private", "sh", "-c",
            f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"', "sh"] + cmd


def _need_mount_namespace(why: str) -> None:
    """Skip where a private mount namespace cannot be made; with HPC_RLX_REQUIRE_NETNS=1 (CI) fail."""
    import shutil
    if os.geteuid() != 0 or not shutil.which("unshare"):
        if os.environ.get("HPC_RLX_REQUIRE_NETNS") == "1":
            pytest.fail(f"HPC_RLX_REQUIRE_NETNS=1 but {why}")
        pytest.skip(why)


def with_read_only(path: Path, cmd: list[str]) -> list[str]:
    """``cmd`` in its own mount namespace where ``path`` is a read-only bind mount of itself:
    a colleague's run or an archive as its reader sees it. Root ignores mode bits, so a chmod
    would not stop a write; a read-only mount does. Nothing leaks to the host's mounts."""
    _need_mount_namespace("a read-only mount needs root and unshare(1)")
    return ["unshare", "-m", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"', str(path)] + cmd


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"


def read_log(run_dir: Path) -> str:
    """Rank 0's log in the run directory (Hydra's job log, hpc_rlx's lines in it)."""
    path = Path(run_dir) / "hpc_rlx.log"
    return path.read_text() if path.exists() else ""


def read_metrics(run_dir: Path) -> list[dict]:
    """The epoch records of metrics.jsonl (event records, e.g. segment starts, left out)."""
    return read_metric_events(run_dir, events=False)


def read_metric_events(run_dir: Path, events: bool = True) -> list[dict]:
    """Every record of metrics.jsonl (events=True), or only those that are not events."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows if events else [r for r in rows if "event" not in r]


def write_small_classification(path: Path, rows: int, seed: int) -> Path:
    """A tiny HDF5 training file: `rows` float32 samples of 6 features, 3 classes."""
    import h5py
    import numpy as np
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        f["x"] = rng.standard_normal((rows, 6)).astype(np.float32)
        f["y"] = rng.integers(0, 3, rows).astype(np.int64)
        f.attrs["num_classes"] = 3
    return path
