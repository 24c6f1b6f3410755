"""Fault-tolerant runs end cleanly (Open MPI 5, `mpirun --with-ft ulfm`).

With Open MPI's failure detector in its own thread (slurm/train.sh's default for
comm.on_failure=shrink|spare) MPI_Finalize never returns in Open MPI 5.0 (hpc_rlx/resilience/ulfm.py,
`detector_thread_on`): the ranks leave without it, and a run without a failure exits 0 within
seconds of its end. A launch that never started the run is not taken for a success.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.jobs import (MPI_IMPL, REPO, explain, launch_prefix, mpi_env,
                                write_small_classification)
from tests.support.mpi_launch import PYTHON, rank_pids

pytestmark = [pytest.mark.mpi, pytest.mark.openmpi]
ULFM = pytest.mark.skipif(MPI_IMPL != "openmpi", reason="ULFM: Open MPI 5's mpirun --with-ft ulfm")

TRAIN_SH = REPO / "slurm" / "train.sh"
SMALL = ["report.plots=false", "report.tensorboard=false", "data=file", "train.epochs=1",
         "train.batch_size=24", "model.hidden=[8]", "comm.on_failure=shrink"]
DETECTOR = ["--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_thread", "true",
            "--mca", "mpi_ft_detector_timeout", "5", "--mca", "mpi_ft_detector_period", "1.25"]
# a run of a few seconds: before the fix every one of them hung in MPI_Finalize until killed
EXIT_BOUND_S = 45
TIMEOUT = 120


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_small_classification(tmp_path_factory.mktemp("clean_exit") / "small.h5", 240, 0)


def _run(cmd, env, cwd=REPO) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    try:
        proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"no exit within {TIMEOUT}s (the finalize hang): {' '.join(map(str, cmd))}\n"
                    f"{e.stdout}\n{e.stderr}")
    return proc, time.monotonic() - t0


def _train_sh_env(n: int, **extra) -> dict:
    env = mpi_env({k: None for k in os.environ if k.startswith("SLURM_")})    # outside Slurm
    env.update(HPC_RLX_NTASKS=str(n), HPC_RLX_VENV=str(Path(PYTHON).parents[1]),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               # more ranks than this machine's cores (PRRTE's own setting for --oversubscribe)
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env.update({k: str(v) for k, v in extra.items()})
    return env


@ULFM
@pytest.mark.parametrize("n", [2, 4])
def test_train_sh_with_the_detector_and_no_failure_exits_0_promptly(tmp_path, data, n):
    """`bash slurm/train.sh comm.on_failure=shrink` outside Slurm, the detector on by default:
    exit 0 within the bound, the run finished (summary.json found through the run's own report
    of its directory, which train.sh reads when it was not given one)."""
    proc, took = _run(["bash", TRAIN_SH, *SMALL, f"data.path={data}"], _train_sh_env(n), cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert "--mca mpi_ft_detector true --mca mpi_ft_detector_thread true" in proc.stdout, proc.stdout
    assert "ranks finished with status 0" in proc.stdout, explain(proc)
    assert took < EXIT_BOUND_S, f"{took:.1f} s: {explain(proc)}"
    (run,) = (tmp_path / "outputs").iterdir()
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


@ULFM
@pytest.mark.parametrize("n", [2, 4])
def test_plain_mpirun_with_ft_ulfm_and_the_detector_exits_0_promptly(tmp_path, data, n):
    prefix = launch_prefix(n)
    cmd = prefix[:1] + ["--with-ft", "ulfm", *DETECTOR] + prefix[1:] + [
        PYTHON, "-m", "hpc_rlx", f"hydra.run.dir={tmp_path / 'run'}", *SMALL, f"data.path={data}"]
    proc, took = _run(cmd, mpi_env())
    assert proc.returncode == 0, explain(proc)
    assert took < EXIT_BOUND_S, f"{took:.1f} s: {explain(proc)}"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"


@ULFM
def test_a_launch_whose_ranks_never_started_the_run_is_not_a_success(tmp_path):
    """mpirun exits 0 without a rank having started the run (as once after ranks crashed in
    MPI_Init under the detector): train.sh says so and exits 3, outside Slurm as inside."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc, _ = _run(["bash", TRAIN_SH, *SMALL, "data.path=unused.h5"],
                   _train_sh_env(2, HPC_RLX_PYTHON=fake, TMPDIR=tmp), cwd=tmp_path)
    assert proc.returncode == 3, explain(proc)
    assert "ranks finished with status 0" in proc.stdout, explain(proc)
    assert "hpc_rlx: error: mpirun exited 0 but no rank started the run" in proc.stderr, explain(proc)
    assert not list(tmp.iterdir()), "train.sh leaves no file behind"


def test_ranks_whose_launcher_died_leave_within_seconds(tmp_path, data):
    """The launcher's process that is the ranks' parent (MPICH's hydra_pmi_proxy, Open MPI's
    prterun) SIGKILLed mid-run, as when a job's mpirun is killed with it: nobody is left to end
    the ranks, which used to poll for ever; each leaves within a few seconds."""
    prefix = launch_prefix(2)
    cmd = prefix + [PYTHON, "-m", "hpc_rlx", f"hydra.run.dir={tmp_path / 'run'}", *SMALL[:-1], f"data.path={data}",
                    "train.epochs=50", "train.progress=lines", "train.log_every_s=0.01", "debug.slowdown={0:50.0,1:50.0}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    ranks: dict[int, int] = {}
    try:
        deadline = time.monotonic() + TIMEOUT
        for line in proc.stdout:
            if "global step 2)" in line:
                break
            assert time.monotonic() < deadline
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 2, ranks
        parents = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in ranks.values()}
        for parent in parents:          # the ranks' parent(s) on this host
            os.kill(parent, signal.SIGKILL)
        t0 = time.monotonic()
        alive = list(ranks.values())
        while alive and time.monotonic() - t0 < 15:
            time.sleep(0.1)
            alive = [pid for pid in alive if _running(pid)]
        assert not alive, f"ranks {alive} still running {time.monotonic() - t0:.1f} s after their launcher died"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
