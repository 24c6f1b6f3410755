"""Slurm: the batch script, preemption and requeue, and Hydra sweeps, on a real local cluster.

The cluster (munged, slurmctld, slurmd on this host) is started once for this module by
`tests/support/slurm_cluster.py`. Where it cannot start the Slurm tests are skipped with the reason,
except on CI (CI=true or HPC_RLX_REQUIRE_SLURM=1), where that is a failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hydra_plugins.hpc_rlx_slurm import launcher as slurm_launcher
from hydra_plugins.hpc_rlx_slurm import slurm_jobs

from tests.support.jobs import REPO, read_metrics, write_small_classification
from tests.support.mpi_launch import MPI_IMPL
from tests.support.slurm_cluster import ClusterUnavailable, JobPoll, SlurmCluster, require_slurm

# the module's cluster fixture is built once, on one pytest-xdist worker
pytestmark = pytest.mark.xdist_group("slurm")

TRAIN_SH = REPO / "slurm" / "train.sh"
VENV = Path(sys.executable).parent.parent
SMALL = ["train.batch_size=64", "model.hidden=[32]", "report.plots=false"]
# 2 ranks of 1 CPU each: fits the 2-core CI machine
RESOURCES = ["--ntasks-per-node=2", "--cpus-per-task=1", "--time=10"]


# ==================================================================================================
# Helpers
# ==================================================================================================

@pytest.fixture(scope="module")
def slurm():
    cluster = SlurmCluster()
    try:
        cluster.start(timeout=90)
    except ClusterUnavailable as exc:
        reason = f"the local Slurm cluster cannot start: {exc}"
        if require_slurm():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    yield cluster
    cluster.stop()


def job_env(cluster: SlurmCluster | None = None, **extra) -> dict:
    env = cluster.env() if cluster else {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    if (VENV / "bin" / "python").exists():
        env["HPC_RLX_VENV"] = str(VENV)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env["HYDRA_FULL_ERROR"] = "0"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, *, env, cwd, timeout, cluster: SlurmCluster | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        # the job logs of a test's own directory (never a walk of "/" or another shared tree)
        logs = "" if Path(cwd) == Path("/") else "\n".join(
            f"--- {p} ---\n{p.read_text()[-3000:]}" for p in Path(cwd).rglob("*.out"))
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish in {timeout}s\n--- stdout ---\n{out[-3000:]}\n"
                    f"--- stderr ---\n{err[-3000:]}\n{logs}\n{cluster.logs() if cluster else ''}")


def sbatch(cluster, cwd: Path, args, *, wait: bool, timeout: float = 60, options=(), **env_extra):
    (cwd / "logs").mkdir(exist_ok=True)
    cmd = ["sbatch", "--parsable", *RESOURCES, *options, *(["--wait"] if wait else []), TRAIN_SH, *args]
    proc = run(cmd, env=job_env(cluster, **env_extra), cwd=cwd, timeout=timeout, cluster=cluster)
    ids = re.findall(r"^(\d+)", proc.stdout, flags=re.M)
    assert ids, f"sbatch printed no job id: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return ids[0], proc


def job_fields(cluster, job_id: str) -> dict:
    """The job's fields, or {} when the controller did not answer in time: slurmctld on a loaded
    machine can take over 30 s for one query, and the caller polls again until its own deadline."""
    try:
        res = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=cluster.env(), cwd="/",
                             capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return {}
    return slurm_jobs.parse_scontrol(res.stdout)


def log_of(cwd: Path, job_id: str) -> str:
    path = cwd / "logs" / f"hpc_rlx-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else f"(no log {path})"


def wait_until(predicate, timeout: float, what: str, cluster=None, on_fail=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{on_fail()}\n"
                f"{cluster.logs() if cluster else ''}")


def wait_job(cluster, cwd: Path, job_id: str, timeout: float) -> dict:
    """Poll until the job ends (sbatch --wait checks only every ~10 s); returns its fields."""
    poll = JobPoll(lambda: job_fields(cluster, job_id))
    wait_until(poll.ended, timeout, f"job {job_id} to finish", cluster, lambda: log_of(cwd, job_id))
    return poll.last


def metric_lines(run_dir: Path) -> int:
    try:
        return len(read_metrics(run_dir))
    except (OSError, ValueError):
        return 0


# ==================================================================================================
# Pure helpers of the sweep launcher (no Slurm needed)
# ==================================================================================================

def test_sbatch_command_options_and_script_arguments():
    cmd = slurm_jobs.sbatch_command(
        script="/r/slurm/train.sh", script_args=["hydra.run.dir=/s/0", "optim.lr=0.1"],
        job_name="hpc_rlx-0", output="/s/0/slurm-%j.out", chdir="/r", nodes=2, ntasks_per_node=4,
        cpus_per_task=8, time="00:30:00", gpus_per_node=4, partition="gpu", account=None,
        qos="", extra=["--exclusive"])
    assert cmd[:2] == ["sbatch", "--parsable"]
    for opt in ("--job-name=hpc_rlx-0", "--output=/s/0/slurm-%j.out", "--chdir=/r", "--nodes=2",
                "--ntasks-per-node=4", "--cpus-per-task=8", "--time=00:30:00", "--gpus-per-node=4",
                "--partition=gpu", "--exclusive"):
        assert opt in cmd
    assert not any(c.startswith(("--account", "--qos")) for c in cmd), "unset options stay out"
    # options before the script; the script's own arguments after it, in order
    i = cmd.index("/r/slurm/train.sh")
    assert all(c.startswith("--") for c in cmd[1:i])
    assert cmd[i + 1:] == ["hydra.run.dir=/s/0", "optim.lr=0.1"]
    assert "--no-kill" not in cmd
    # a point that survives a dead rank keeps its allocation when a node fails
    cmd = slurm_jobs.sbatch_command(
        script="/r/slurm/train.sh", script_args=["comm.on_failure=spare", "comm.spares=1"], job_name="p",
        output="o", chdir="/r", nodes=2, ntasks_per_node=4, cpus_per_task=1)
    assert "--no-kill" in cmd[:cmd.index("/r/slurm/train.sh")]


def test_hydra_value_quotes_only_when_needed():
    assert slurm_jobs.hydra_value("/scratch/me/multirun/2024-01-01_10-00-00/3") == \
        "/scratch/me/multirun/2024-01-01_10-00-00/3"
    assert slurm_jobs.hydra_value("/data/my runs/0") == "'/data/my runs/0'"
    assert slurm_jobs.hydra_value("/a/it's") == "'/a/it\\'s'"


def test_hydra_overrides_that_describe_the_sweep_are_not_passed_to_points():
    kept = slurm_launcher.passthrough_hydra_overrides(
        ["hydra/launcher=slurm", "hydra.launcher.nodes=2", "+hydra.launcher.env.X=1",
         "hydra.sweep.dir=/s", "hydra/sweeper=basic", "hydra.job.chdir=true", "hydra.verbose=true"])
    assert kept == ["hydra.job.chdir=true", "hydra.verbose=true"]


def test_job_environment_drops_enclosing_job_and_mpi_identity():
    env = slurm_jobs.job_environment(
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_CONF": "/c", "PMI_RANK": "0",
         "OMPI_COMM_WORLD_SIZE": "4", "HOME": "/root", "SBATCH_ACCOUNT": "a"}, {"EXTRA": 1})
    assert env == {"SLURM_CONF": "/c", "HOME": "/root", "SBATCH_ACCOUNT": "a", "EXTRA": "1"}


def test_parse_squeue_and_scontrol():
    assert slurm_jobs.parse_squeue("12|RUNNING|None\n13|PENDING|BeginTime\n") == {
        "12": ("RUNNING", "None"), "13": ("PENDING", "BeginTime")}
    f = slurm_jobs.parse_scontrol("JobId=12 JobName=hpc_rlx-0 JobState=FAILED Reason=NonZeroExitCode "
                                  "ExitCode=1:0 Restarts=0")
    assert (f["JobState"], f["ExitCode"], f["Reason"]) == ("FAILED", "1:0", "NonZeroExitCode")
    assert slurm_jobs.JobState("1", "PENDING").done is False
    assert slurm_jobs.JobState("1", "TIMEOUT").done is True


class FakeSlurm:
    """Stands in for sbatch/squeue: each job runs for `polls` polls, then ends in `final`."""

    def __init__(self, polls=2, final="COMPLETED"):
        self.polls, self.final = polls, final
        self.age, self.max_active, self.cancelled = {}, 0, []

    def submit(self, cmd, env=None, timeout=60.0):
        job = str(100 + len(self.age))
        self.age[job] = 0
        return job

    def poll(self, ids, env=None, timeout=60.0):
        ids = list(ids)
        self.max_active = max(self.max_active, len(ids))
        out = {}
        for job in ids:
            self.age[job] += 1
            state = self.final if self.age[job] > self.polls else "RUNNING"
            out[job] = slurm_jobs.JobState(job, state, "0:0" if state == "COMPLETED" else "1:0")
        return out

    def cancel(self, ids, env=None):
        self.cancelled += list(ids)


def _points(tmp_path, n):
    return [slurm_launcher._Point(i, [f"optim.lr=0.{i + 1}"], tmp_path / str(i), f"hpc_rlx-{i}",
                                  ["sbatch"], None) for i in range(n)]


def _fake_launcher(monkeypatch, fake, **params):
    for name in ("submit", "poll", "cancel"):
        monkeypatch.setattr(slurm_jobs, name, getattr(fake, name))
    conf = dict(slurm_launcher.SlurmLauncherConf().__dict__, poll_interval_s=0.01, **params)
    conf.pop("_target_")
    return slurm_launcher.SlurmLauncher(**conf)


def test_launcher_keeps_at_most_max_running_points_in_flight(tmp_path, monkeypatch):
    fake = FakeSlurm()
    launcher = _fake_launcher(monkeypatch, fake, max_running=2)
    points = _points(tmp_path, 5)
    launcher._run_all(points, {})
    assert fake.max_active == 2 and len(fake.age) == 5
    assert all(p.state.state == "COMPLETED" for p in points)
    assert (tmp_path / "3" / "overrides.txt").read_text() == "optim.lr=0.4\n"


def test_launcher_results_need_a_summary(tmp_path, monkeypatch):
    launcher = _fake_launcher(monkeypatch, FakeSlurm())
    points = _points(tmp_path, 2)
    launcher._run_all(points, {})
    (tmp_path / "0" / "summary.json").write_text(json.dumps({"final": {"val_loss": 0.25}}))
    ok, missing = (launcher._job_return(p) for p in points)
    assert ok.status.name == "COMPLETED" and ok.return_value == 0.25
    assert missing.status.name == "FAILED"
    with pytest.raises(slurm_launcher.SweepPointFailed, match="ended COMPLETED.*but wrote no"):
        _ = missing.return_value


def test_launcher_timeout_cancels_what_is_left(tmp_path, monkeypatch):
    fake = FakeSlurm(polls=10**9)
    launcher = _fake_launcher(monkeypatch, fake, max_running=1, timeout_min=0.001)
    points = _points(tmp_path, 3)
    launcher._run_all(points, {})
    assert fake.cancelled == ["100"], "the running point is cancelled, the others never submitted"
    assert [p.state.state for p in points] == ["TIMEOUT"] * 3
    assert points[2].job_id is None
    with pytest.raises(slurm_launcher.SweepPointFailed, match="timeout_min"):
        _ = launcher._job_return(points[0]).return_value


# ==================================================================================================
# The batch script without Slurm
# ==================================================================================================

def sbatch_header(path: Path) -> list[str]:
    return [line.split(None, 1)[1].strip() for line in path.read_text().splitlines()
            if line.startswith("#SBATCH ")]


def test_train_sh_header_has_the_documented_directives():
    header = sbatch_header(TRAIN_SH)
    keys = {h.split("=", 1)[0] for h in header}
    for key in ("--job-name", "--nodes", "--ntasks-per-node", "--cpus-per-task", "--time"):
        assert key in keys, f"{key} missing from the #SBATCH header: {header}"
    assert "--signal=USR1@90" in header and "--requeue" in header
    assert "--output=logs/%x-%j.out" in header
    assert re.search(r"^##SBATCH --gpus", TRAIN_SH.read_text(), flags=re.M), "commented GPU line"
    proc = subprocess.run(["bash", "-n", str(TRAIN_SH)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.mpi
def test_train_sh_outside_slurm_launches_mpirun_with_one_blas_thread(tmp_path):
    env = job_env(None, HPC_RLX_MODULE="hpc_rlx.doctor", HPC_RLX_NTASKS=2)
    proc = run(["bash", TRAIN_SH, "--json"], env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    start, end = proc.stdout.index("{"), proc.stdout.rindex("}") + 1
    assert "launcher: mpirun -n 2 (not in a Slurm job)" in proc.stdout[:start]
    assert "ranks finished with status 0" in proc.stdout[end:]
    report = json.loads(proc.stdout[start:end])
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert all(r["env"]["OMP_NUM_THREADS"] == "1" and r["blas_threads"] == 1 for r in report["ranks"])


@pytest.mark.mpi
@pytest.mark.openmpi
@pytest.mark.skipif(MPI_IMPL != "openmpi", reason="ULFM: Open MPI 5's mpirun --with-ft ulfm")
def test_train_sh_launches_a_fault_tolerant_run_with_mpirun_with_ft_ulfm(tmp_path):
    """comm.on_failure=shrink|spare needs ULFM, which only Open MPI's `mpirun --with-ft ulfm`
    gives (not a rank srun starts): train.sh launches so, and a rank killed at step 5 leaves
    the other to train on; asking for srun is refused with the reason."""
    data = write_small_classification(tmp_path / "small.h5", 480, 0)
    env = job_env(None, HPC_RLX_NTASKS=2, OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
    args = ["data=file", f"data.path={data}", "train.epochs=2", "train.batch_size=24", "model.hidden=[8]",
            "report.plots=false", "comm.on_failure=shrink"]
    proc = run(["bash", TRAIN_SH, *args, f"hydra.run.dir={tmp_path / 'run'}", "debug.fail_rank=1",
                "debug.fail_point=step", "debug.fail_step=5", "debug.fail_mode=kill"],
               env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Open MPI's failure detector on by default: 5 s without a heartbeat, one every 1.25 s
    assert ("launcher: mpirun --with-ft ulfm --mca mpi_ft_detector true --mca mpi_ft_detector_thread true "
            "--mca mpi_ft_detector_timeout 5 --mca mpi_ft_detector_period 1.25 -n 2 (comm.on_failure=shrink: "
            "Open MPI's ULFM, which srun cannot start)") in proc.stdout, proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 1 and [f["ranks"] for f in summary["failures"]] == [[1]], summary
    proc = run(["bash", TRAIN_SH, *args, "--help"], env=dict(env, HPC_RLX_FT_DETECTOR_S="0"), cwd=tmp_path,
               timeout=120)
    assert "launcher: mpirun --with-ft ulfm -n 2 (comm.on_failure=shrink" in proc.stdout, proc.stdout
    proc = run(["bash", TRAIN_SH, *args], env=dict(env, HPC_RLX_LAUNCHER="srun"), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert ("comm.on_failure=shrink needs MPI's fault tolerance (ULFM), which a rank started by srun does "
            "not have") in proc.stderr, proc.stderr


# ==================================================================================================
# On the cluster
# ==================================================================================================

@pytest.mark.slurm
@pytest.mark.parametrize("mpi_type", ["auto", "none"])
def test_train_sh_finds_a_working_launcher(slurm, tmp_path, mpi_type):
    """auto: whatever this site's srun/MPI pair supports; none: srun cannot start MPI -> mpirun."""
    extra = {"HPC_RLX_MODULE": "hpc_rlx.doctor"}
    if mpi_type != "auto":
        extra["SLURM_MPI_TYPE"] = mpi_type
    job, _ = sbatch(slurm, tmp_path, [], wait=False, **extra)
    fields = wait_job(slurm, tmp_path, job, 120)
    log = log_of(tmp_path, job)
    assert fields["JobState"] == "COMPLETED", log
    launch = re.search(r"launcher: (.*)", log).group(1)
    if mpi_type == "none":
        assert launch.startswith("mpirun -n 2 (no srun MPI plugin starts this MPI)"), log
    else:
        assert launch.startswith(("srun --mpi=", "mpirun -n 2")), log
    # the ranks form ONE world of 2, with BLAS threads = CPUs per task
    assert "world size    2" in log and "2 rank(s) on 1 node(s)" in log, log
    assert f"job {job}," in log
    row = next(line.split() for line in log.splitlines() if line.strip().startswith(slurm.node + " "))
    assert row[1:5] == ["0-1", "2", str(len(os.sched_getaffinity(0))), "1"], log
    assert "oversubscribed" not in log, log


@pytest.mark.slurm
def test_sbatch_train_sh_trains_and_writes_everything(slurm, tmp_path):
    job, proc = sbatch(slurm, tmp_path, ["train.epochs=2", *SMALL], wait=True, timeout=240)
    log = log_of(tmp_path, job)
    assert proc.returncode == 0, f"{proc.stderr}\n{log}"
    assert "2 ranks, 1 BLAS threads per rank" in log and "epoch 2/2" in log, log
    # a batch log gets plain progress lines: no carriage returns, no escape codes
    assert "\r" not in log and "\x1b" not in log, repr(log[-2000:])
    assert re.search(r"^\[hpc_rlx\] completed in .*; run directory ", log, flags=re.M), log
    # the run directory carries the job id, so a requeued job finds its own checkpoints
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == [f"slurm-{job}"]
    run_dir = tmp_path / "outputs" / f"slurm-{job}"
    for name in ("metrics.jsonl", "summary.json", "model.h5", "config.yaml"):
        assert (run_dir / name).is_file(), f"{name} missing in {sorted(p.name for p in run_dir.iterdir())}"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("ckpt-*.h5")), "no checkpoints"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert summary["epochs_completed"] == 2
    assert [m["epoch"] for m in read_metrics(run_dir) if "epoch" in m][-1] == 2
    assert "ranks finished with status 0" in log and "requeueing" not in log, log
    fields = job_fields(slurm, job)
    assert fields["JobState"] == "COMPLETED" and fields["NumTasks"] == "2"


@pytest.mark.slurm
@pytest.mark.openmpi
@pytest.mark.skipif(MPI_IMPL != "openmpi", reason="ULFM: Open MPI 5's mpirun --with-ft ulfm")
def test_sbatch_no_kill_shrink_job_trains_on_after_a_dead_rank_in_its_allocation(slurm, tmp_path):
    """`sbatch --no-kill slurm/train.sh comm.on_failure=shrink`, in a real allocation: train.sh
    launches `mpirun --with-ft ulfm` inside it, rank 1 dies at step 5 (SIGKILL), the survivor
    trains on, and Slurm records the job COMPLETED."""
    data = write_small_classification(tmp_path / "small.h5", 480, 0)
    args = ["data=file", f"data.path={data}", "train.epochs=2", "train.batch_size=24", "model.hidden=[8]",
            "report.plots=false", "comm.on_failure=shrink", "debug.fail_rank=1", "debug.fail_point=step",
            "debug.fail_step=5", "debug.fail_mode=kill"]
    job, proc = sbatch(slurm, tmp_path, args, wait=True, timeout=240, options=["--no-kill"],
                       OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
    log = log_of(tmp_path, job)
    assert proc.returncode == 0, f"{proc.stderr}\n{log}"
    assert re.search(r"launcher: mpirun --with-ft ulfm .*-n 2 \(comm\.on_failure=shrink", log), log
    assert re.search(r"rank 1 on \S+ failed: 1 of 2 ranks train on from step 5", log), log
    summary = json.loads((tmp_path / "outputs" / f"slurm-{job}" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 1, summary
    assert [f["ranks"] for f in summary["failures"]] == [[1]], summary
    assert job_fields(slurm, job)["JobState"] == "COMPLETED"


@pytest.mark.slurm
def test_sbatch_train_sh_as_shipped_runs_on_a_two_cpu_node(slurm, tmp_path):
    """The README's sbatch line as pasted, no resource options at all: the header's defaults
    must fit a 1-node, 2-CPU cluster (a request no node can meet pends forever with
    Reason=PartitionConfig)."""
    readme = (REPO / "README.md").read_text()
    running = readme[readme.index("\n## Running\n"):readme.index("\n## ", readme.index("\n## Running\n") + 1)]
    line = next(ln for ln in running.splitlines() if ln.startswith("sbatch slurm/train.sh "))
    args = line.split("#")[0].split()[2:]          # the README's overrides, as pasted
    assert args and not any(a.startswith("-") for a in args), line
    (tmp_path / "logs").mkdir()
    proc = run(["sbatch", "--parsable", TRAIN_SH, *args], env=job_env(slurm),
               cwd=tmp_path, timeout=60, cluster=slurm)
    assert proc.returncode == 0, f"sbatch refused the script as shipped: {proc.stdout}{proc.stderr}"
    job = re.findall(r"^(\d+)", proc.stdout, flags=re.M)[0]

    def ended() -> bool:
        fields = job_fields(slurm, job)
        if fields.get("JobState") == "PENDING" and fields.get("Reason") == "PartitionConfig":
            run(["scancel", job], env=slurm.env(), cwd=tmp_path, timeout=30)
            pytest.fail(f"the job as shipped can never start on this {slurm.cpus}-CPU node "
                        f"(Reason=PartitionConfig): {fields}")
        return fields.get("JobState") in slurm_jobs.TERMINAL
    wait_until(ended, 240, f"job {job} to finish", slurm, lambda: log_of(tmp_path, job))
    fields, log = job_fields(slurm, job), log_of(tmp_path, job)
    assert fields["JobState"] == "COMPLETED", log
    assert int(fields["NumTasks"]) >= 1 and int(fields["NumCPUs"]) <= slurm.cpus, fields
    summary = json.loads((tmp_path / "outputs" / f"slurm-{job}" / "summary.json").read_text())
    assert summary["status"] == "completed", log
    assert "\r" not in log and "\x1b" not in log, repr(log[-2000:])


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("trigger", ["usr1", "scontrol-requeue"])
def test_preempted_job_checkpoints_requeues_and_resumes(slurm, tmp_path, trigger):
    """usr1: the time-limit warning (scancel --signal=USR1); the job requeues itself.
    scontrol-requeue: Slurm requeues the job (SIGTERM to every rank)."""
    epochs = 12
    # 22 steps per epoch, a few ms each on a fast machine: rank 1 sleeps 8 s at step 30 (in
    # epoch 2, and again at the first step of the requeued run), so the signal sent once the
    # first epoch is in lands mid-run however fast the machine; no stall report under the
    # default stall_warning_s (60 s)
    args = [f"train.epochs={epochs}", *SMALL, "debug.stall_rank=1", "debug.stall_step=30",
            "debug.stall_s=8"]
    job, _ = sbatch(slurm, tmp_path, args, wait=False)
    run_dir = tmp_path / "outputs" / f"slurm-{job}"
    show = lambda: log_of(tmp_path, job)  # noqa: E731
    wait_until(lambda: metric_lines(run_dir) >= 1, 120, "the first epoch", slurm, show)

    cmd = ["scancel", "--signal=USR1", job] if trigger == "usr1" else ["scontrol", "requeue", job]
    sig = run(cmd, env=slurm.env(), cwd=tmp_path, timeout=30)
    assert sig.returncode == 0, sig.stderr

    # a requeued job may start again after the cluster's cred_expire (10 s here, 120 s by default)
    fields = wait_job(slurm, tmp_path, job, 240)
    log = show()
    assert fields["JobState"] == "COMPLETED", log
    assert fields["Restarts"] == "1", f"the job was not requeued exactly once\n{log}"
    assert "stop requested (signal)" in log and "checkpoint (preempt)" in log, log
    if trigger == "usr1":
        assert f"requeueing job {job}" in log, log
    else:
        assert "requeueing job" not in log, "Slurm requeued it already"
    assert "restart 1 on" in log, log
    saved = re.search(r"checkpoint \(preempt\) at step \d+: (\S+\.h5)", log)
    resumed = re.search(r"resumed from (\S+?\.h5)", log)
    assert saved and resumed, log
    assert resumed.group(1) == saved.group(1), "the second run must start from the preemption checkpoint"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["epochs_completed"] == epochs
    epochs_logged = [m["epoch"] for m in read_metrics(run_dir) if "epoch" in m]
    assert epochs_logged == list(range(1, epochs + 1)), "every epoch exactly once across the requeue"
    assert list((tmp_path / "outputs").iterdir()) == [run_dir], "one run directory for both runs"


@pytest.mark.slurm
@pytest.mark.slow
def test_runs_of_one_batch_script_share_a_directory_only_for_the_same_training(slurm, tmp_path):
    """Three slurm/train.sh runs in one job: another learning rate gets slurm-<job>.1, the first
    config run longer continues slurm-<job>; train.sh reads each run's own directory."""
    (tmp_path / "logs").mkdir()
    common = " ".join([*SMALL, "train.epochs={}"])
    script = tmp_path / "three_runs.sh"
    script.write_text("#!/bin/bash\nset -e\n" + "".join(
        f"bash {TRAIN_SH} {common.format(epochs)} optim.lr={lr}\n"
        for lr, epochs in (("0.1", 1), ("0.05", 1), ("0.1", 2))))
    proc = run(["sbatch", "--parsable", *RESOURCES, "--job-name=hpc_rlx", "--output=logs/%x-%j.out",
                script], env=job_env(slurm), cwd=tmp_path, timeout=60, cluster=slurm)
    job = re.findall(r"^(\d+)", proc.stdout, flags=re.M)[0]
    fields = wait_job(slurm, tmp_path, job, 400)
    log = log_of(tmp_path, job)
    assert fields["JobState"] == "COMPLETED", log
    first, second = tmp_path / "outputs" / f"slurm-{job}", tmp_path / "outputs" / f"slurm-{job}.1"
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == [first.name, second.name], log
    assert re.findall(r"^hpc_rlx: run directory: (\S+)", log, flags=re.M) == [
        f"outputs/{first.name}", f"outputs/{second.name}", f"outputs/{first.name}"], log
    assert [m["epoch"] for m in read_metrics(first)] == [1, 2], log
    assert [m["epoch"] for m in read_metrics(second)] == [1], log
    assert log.count("[hpc_rlx] resumed from") == 1 and f"resumed from {first}" in log, log
    assert "optim:\n  name: sgd\n  lr: 0.1" in (first / "config.yaml").read_text()
    assert (first / "config.segment-2.yaml").is_file() and not (second / "config.segment-2.yaml").exists()
    assert log.count("ranks finished with status 0") == 3 and "requeueing" not in log, log


def _sweep(slurm, cwd: Path, overrides, timeout=300):
    cmd = [sys.executable, "-m", "hpc_rlx", "-m", "hydra/launcher=slurm",
           "hydra.launcher.ntasks_per_node=2", "hydra.launcher.cpus_per_task=1",
           "hydra.launcher.time=00:10:00", "hydra.launcher.poll_interval_s=0.5", *overrides]
    return run(cmd, env=job_env(slurm, OMP_NUM_THREADS=1), cwd=cwd, timeout=timeout, cluster=slurm)


@pytest.mark.slurm
@pytest.mark.slow
def test_hydra_sweep_runs_each_point_as_its_own_slurm_mpi_job(slurm, tmp_path):
    proc = _sweep(slurm, tmp_path, ["optim.lr=0.1,0.05", "train.epochs=1", *SMALL])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    sweeps = list((tmp_path / "multirun").iterdir())
    assert len(sweeps) == 1, sweeps
    sweep = sweeps[0]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"], "no stray directories"
    assert not (tmp_path / "outputs").exists()
    jobs = set()
    for point, lr in (("0", "0.1"), ("1", "0.05")):
        d = sweep / point
        recorded = (d / "overrides.txt").read_text().split()
        assert recorded[0] == f"optim.lr={lr}"
        assert [o.split("=")[0] for o in recorded[1:]] == [o.split("=")[0] for o in ["train.epochs=1", *SMALL]]
        summary = json.loads((d / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["world_size"] == 2
        logs = list(d.glob("slurm-*.out"))
        assert len(logs) == 1
        job = logs[0].stem.split("-")[1]
        jobs.add(job)
        assert "2 ranks" in logs[0].read_text()
        fields = job_fields(slurm, job)
        assert fields["JobState"] == "COMPLETED" and fields["NumTasks"] == "2", fields
        assert (fields["JobName"], fields["WorkDir"]) == (f"hpc_rlx-{point}", str(tmp_path))
    assert len(jobs) == 2, "one Slurm job per point"
    rows = json.loads((sweep / "sweep_summary.json").read_text())
    assert [(r["point"], r["overrides"].split()[0], r["status"]) for r in rows] == [
        ("0", "optim.lr=0.1", "completed"), ("1", "optim.lr=0.05", "completed")]
    assert all(isinstance(r["val_loss"], float) for r in rows)
    assert "optim.lr=0.05" in (sweep / "sweep_summary.md").read_text()


@pytest.mark.slurm
@pytest.mark.slow
def test_hydra_sweep_reports_a_failed_point_with_its_log(slurm, tmp_path):
    proc = _sweep(slurm, tmp_path, ["debug.fail_rank=null,1", "debug.fail_point=startup",
                                    "train.epochs=1", *SMALL])
    assert proc.returncode != 0, proc.stdout[-3000:]
    err = proc.stdout + proc.stderr
    assert "sweep point #1 (debug.fail_rank=1" in err and "ended FAILED" in err, err[-4000:]
    assert "injected failure (debug.fail_point=startup)" in err, "the point's log tail is shown"
    sweep = next((tmp_path / "multirun").iterdir())
    rows = {r["point"]: r for r in json.loads((sweep / "sweep_summary.json").read_text())}
    assert rows["0"]["status"] == "completed"
    assert rows["1"]["status"] == "missing summary.json"


@pytest.mark.slurm
@pytest.mark.slow
def test_ctrl_c_on_a_slurm_sweep_cancels_its_jobs_quietly(slurm, tmp_path):
    """The sweep launcher is no training rank: Ctrl-C cancels the jobs it submitted, then exit 130."""
    cmd = [sys.executable, "-m", "hpc_rlx", "-m", "hydra/launcher=slurm",
           "hydra.launcher.ntasks_per_node=2", "hydra.launcher.cpus_per_task=1",
           "hydra.launcher.time=00:10:00", "hydra.launcher.poll_interval_s=0.5",
           "optim.lr=0.1,0.05", "train.epochs=100000", *SMALL]
    proc = subprocess.Popen([str(c) for c in cmd], env=job_env(slurm, OMP_NUM_THREADS=1), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out, jobs = [], []
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            out.append(line)
            jobs += re.findall(r"-> Slurm job (\d+)", line)
            if jobs or time.monotonic() > deadline:
                break
        assert jobs, "".join(out)
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)        # a terminal's Ctrl-C
        rest, _ = proc.communicate(timeout=60)
        out.append(rest)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    text = "".join(out)
    assert proc.returncode == 130, text[-3000:]
    assert "cancelling Slurm jobs" in text and "hpc_rlx: interrupted" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = {job_fields(slurm, j).get("JobState") for j in jobs}
        if states <= {"CANCELLED"}:
            break
        time.sleep(1)
    assert states == {"CANCELLED"}, states
