"""`python -m hpc_rlx.doctor`: the analysis on made-up clusters, and the real report under mpirun."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import h5py
import pytest

from hpc_rlx.comm.node_memory import largest_shared_bucket, shm_free_bytes
from hpc_rlx.doctor import check as doctor, probe as doctor_probe

from tests.support.jobs import MPI_IMPL, REPO, explain, launch_cmd, mpi_env, mpirun, with_private_dev_shm

# how the report names each MPI's library and launcher
EXPECTED_LIBRARY = {"mpich": "library       MPICH Version: ", "openmpi": "library       Open MPI v5."}
EXPECTED_LAUNCHER = {"mpich": "launched by   MPICH mpirun / mpiexec (hydra)",
                     "openmpi": "launched by   Open MPI mpirun (prterun)"}


def rec(rank, size, host="n1", cores=(0, 1), threads=1, env=None, **extra):
    r = {"rank": rank, "size": size, "host": host, "pid": 1000 + rank, "cpu_count": len(cores),
         "cores": list(cores), "env": dict(env or {}), "blas_threads": threads,
         "blas": [{"api": "openblas", "version": "0.3", "threads": threads, "layer": "pthreads"}],
         "gpus": 0, "gpus_how": "test", "python": "3.11.7", "numpy": "2.0", "h5py": "3.1",
         "hdf5": "1.14", "mpi4py": "4.0", "mpi_library": "MPICH 4", "hpc_rlx": "0.1.0",
         "run_dir": {"path": "/x/outputs", "exists": True, "checked": "/x/outputs",
                     "writable": True, "why": ""}}
    r.update(extra)
    return r


def cluster(hosts: dict, threads=1, env=None):
    """{host: ranks on it} -> records, ranks numbered host by host."""
    size = sum(hosts.values())
    out, rank = [], 0
    for host, n in hosts.items():
        for _ in range(n):
            out.append(rec(rank, size, host, threads=threads, env=env))
            rank += 1
    return out


# ---------------------------------------------------------------------------------- analysis

def test_balanced_job_has_no_warnings():
    assert doctor.analyse(cluster({"n1": 2, "n2": 2})) == []


def test_a_small_dev_shm_is_reported_with_the_largest_bucket_it_sums():
    small = cluster({"n1": 8, "n2": 8})
    for r in small:
        r["cores"] = list(range(8))
        r["shm_free"] = (64 if r["host"] == "n1" else 16384) * 1024 * 1024
    w = doctor.analyse(small)
    # n1: 64 MiB / 1.25 headroom / 8 ranks = 6.4 MiB a rank; n2's 16 GiB is plenty
    assert len(w) == 1 and w[0].startswith("n1: /dev/shm has 64 MiB free"), w
    assert "buckets of at most 6.4 MiB a rank (1.7 M float32 parameters) with 8 ranks" in w[0], w
    text = doctor.format_report(small, w)
    assert "/dev/shm      n1: 64 MiB free: comm.shared_memory sums buckets up to 6 MiB a rank with 8" in text
    assert "/dev/shm      n2: 16,384 MiB free" in text
    # one rank on a node has nothing to share: no warning whatever /dev/shm holds
    alone = [rec(0, 1, cores=(0,), shm_free=1024 * 1024)]
    assert doctor.analyse(alone) == []


def test_more_ranks_than_cores_is_reported_with_the_numbers():
    w = doctor.analyse(cluster({"n1": 3, "n2": 2}))
    assert len(w) == 1
    assert "n1: 3 ranks share 2 usable cores" in w[0] and "1.5x" in w[0]


def test_ranks_times_blas_threads_above_cores_is_oversubscription():
    w = doctor.analyse(cluster({"n1": 2}, threads=2, env={"OMP_NUM_THREADS": "4"}))
    assert len(w) == 1
    assert "n1: OMP_NUM_THREADS=4 gives 2 ranks x 4 threads = 8 threads on 2 cores" in w[0]
    assert "OMP_NUM_THREADS=1" in w[0]


def test_report_shows_the_threads_training_will_use_not_the_doctors_own():
    # 2 ranks on 2 cores, no thread setting: OpenBLAS starts 2 threads in each doctor process,
    # but training gives each rank cores / ranks per node = 1.
    recs = cluster({"n1": 2}, threads=2)
    assert doctor.analyse(recs) == []
    rows = [line.split() for line in doctor.format_report(recs, []).splitlines()]
    assert ["n1", "0-1", "2", "2", "1", "2", "0"] in rows
    text = doctor.format_report(recs, [], settings={"threads_per_rank": None, "cpu_lanes": 2})
    assert "cores / ranks per node / 2 CPU lanes" in text


def test_the_shared_training_rule_gives_the_doctors_numbers():
    from hpc_rlx.device.threads import training_threads
    recs = [rec(r, 3, cores=range(8)) for r in range(3)]
    assert doctor.host_train_threads(recs, None) == [training_threads(None, 8, 3)] * 3 == [2, 2, 2]
    assert doctor.host_train_threads(recs, {"threads_per_rank": 5, "cpu_lanes": 1}) == [5, 5, 5]


def test_explicit_threads_per_rank_above_cores_warns():
    recs = cluster({"n1": 2, "n2": 2})
    w = doctor.analyse(recs, settings={"threads_per_rank": 4, "cpu_lanes": 1})
    assert len(w) == 2, w
    assert w[0].startswith("n1: train.threads_per_rank=4 gives 2 ranks x 4 threads = 8 threads on 2 cores")
    assert "train.threads_per_rank=1" in w[0]
    rows = [line.split() for line in doctor.format_report(recs, w, settings={"threads_per_rank": 4}).splitlines()]
    assert ["n1", "0-1", "2", "2", "4", "8", "0"] in rows
    assert doctor.analyse(recs, settings={"threads_per_rank": 1, "cpu_lanes": 1}) == []


@pytest.mark.parametrize("var", ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"])
def test_a_thread_variable_above_cores_warns_even_when_blas_reports_fewer(var):
    # the variable is what the ranks' other pools follow, whatever this BLAS reports
    w = doctor.analyse(cluster({"n1": 2}, threads=1, env={var: "2"}))
    assert len(w) == 1 and f"{var}=2 gives 2 ranks x 2 threads = 4 threads on 2 cores" in w[0]
    assert doctor.analyse(cluster({"n1": 2}, threads=1, env={var: "1"})) == []


def test_blas_threads_above_slurm_cpus_per_task():
    recs = [rec(0, 1, cores=range(8), threads=4, env={"SLURM_CPUS_PER_TASK": "2"})]
    w = doctor.analyse(recs)
    assert any("Slurm gave each task 2 CPUs but BLAS runs 4 threads" in x for x in w)


def test_ranks_pinned_to_one_core():
    recs = [rec(r, 2, cores=(0,)) for r in range(2)]
    w = doctor.analyse(recs)
    assert any("pinned to the same core(s) [0]" in x for x in w)


def test_srun_without_matching_pmi_is_caught():
    recs = [rec(0, 1, env={"SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0", "SLURM_MPI_TYPE": "none"})]
    w = doctor.analyse(recs)
    assert len(w) == 1 and "srun started 4 tasks but MPI sees a world of 1" in w[0]
    assert "--mpi=none" in w[0]


def test_mixed_software_names_the_ranks():
    recs = cluster({"n1": 2, "n2": 2})
    for r in recs[2:]:
        r["h5py"] = "3.9"
    w = doctor.analyse(recs)
    assert len(w) == 1
    assert "different h5py" in w[0] and "3.1 on ranks 0-1" in w[0] and "3.9 on ranks 2-3" in w[0]


def test_unwritable_and_unshared_run_dir():
    recs = cluster({"n1": 1, "n2": 2})
    recs[2]["run_dir"].update(writable=False, why="PermissionError: Permission denied")
    w = doctor.analyse(recs, shared={"checked": True, "missing": [1, 2], "dir": "/local"})
    assert any("cannot be written on ranks 2" in x and "Permission denied" in x for x in w)
    assert any("not shared: ranks 1-2" in x for x in w)


def test_gpus_without_cuda_aware_mpi():
    recs = [rec(0, 1, gpus=4, cuda_aware="no")]
    assert any("not CUDA-aware" in x for x in doctor.analyse(recs))
    recs[0]["cuda_aware"] = "yes"
    assert doctor.analyse(recs) == []


def test_a_gpu_that_cannot_run_kernels_is_named_with_its_ranks():
    ok = {"index": 0, "physical": "0", "problem": ""}
    broken = {"index": 1, "physical": "3", "problem": "CompileException: cannot load nvrtc"}
    cores = (0, 1, 2, 3)
    recs = [rec(0, 3, cores=cores, gpus=2, cuda_aware="yes", gpu_check=ok),
            rec(1, 3, cores=cores, gpus=2, cuda_aware="yes", gpu_check=broken),
            rec(2, 3, cores=cores, gpus=2, cuda_aware="yes", gpu_check=dict(broken))]
    warnings = doctor.analyse(recs)
    assert len(warnings) == 1, warnings
    assert "GPU 3 on n1 cannot run a GPU lane (ranks 1-2)" in warnings[0]
    assert "cannot load nvrtc" in warnings[0] and "[ctk]" in warnings[0]
    assert "1 of 3 rank(s)" not in doctor.format_report(recs, warnings)
    assert "2 of 3 rank(s) cannot run on their GPU" in doctor.format_report(recs, warnings)
    for r in recs:
        r["gpu_check"] = dict(ok)
    assert doctor.analyse(recs) == []
    assert "ok on the GPU of each of 3 rank(s)" in doctor.format_report(recs, [])


def test_gpu_check_without_cupy_is_skipped_and_the_smoke_test_says_why():
    from hpc_rlx.base import backend
    if backend.cupy_available():
        pytest.skip("CuPy sees a GPU here: the GPU tests cover the smoke test")
    assert doctor_probe.gpu_check(0) is None
    assert "CuPy" in backend.smoke_test(0)


def test_missing_logs_dir_next_to_train_sh():
    recs = cluster({"n1": 1})
    assert any("mkdir -p logs" in x for x in doctor.analyse(recs, cwd_files={"train_sh": True, "logs": False}))
    assert doctor.analyse(recs, cwd_files={"train_sh": True, "logs": True}) == []


def test_a_data_file_missing_on_some_ranks_is_named_with_them():
    recs = cluster({"n1": 2, "n2": 2})
    for r in recs:
        r["data_files"] = {"/scratch/d.h5": None if r["host"] == "n1" else "does not exist"}
    read = {"data_distribution": "read", "data_files": ["/scratch/d.h5"]}
    (w,) = doctor.data_file_warnings(recs, read)
    assert w.startswith("data file /scratch/d.h5 does not exist on ranks 2-3 (n2): the run would stop")
    assert "data.distribution=scatter" in w
    # with scatter only rank 0 reads the file, and it has it
    assert doctor.data_file_warnings(recs, {**read, "data_distribution": "scatter"}) == []
    for r in recs:
        r["data_files"] = {"/scratch/d.h5": None}
    assert doctor.data_file_warnings(recs, read) == []


def test_rank_span():
    assert doctor.rank_span([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"


def test_report_lists_every_host_and_the_warnings():
    recs = cluster({"a1": 2, "b2": 1})
    text = doctor.format_report(recs, ["something odd"], shared={"checked": True, "missing": []})
    assert "3 rank(s) on 2 node(s)" in text
    lines = [line.split() for line in text.splitlines()]
    assert ["a1", "0-1", "2", "2", "1", "2", "0"] in lines
    assert ["b2", "2", "1", "2", "2", "2", "0"] in lines     # a lone rank trains on both cores
    assert "! something odd" in text and "shared by all ranks: yes" in text


def test_launcher_names():
    assert doctor.launcher({"SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_JOB_ID": "9",
                            "SLURM_MPI_TYPE": "pmi2"}, 4).startswith("srun (job 9, step 3, --mpi=pmi2")
    assert doctor.launcher({"PMI_SIZE": "4"}, 4) == "mpirun / mpiexec"
    assert doctor.launcher({"PMI_SIZE": "4", "HYDI_CONTROL_FD": "7"}, 4) == "MPICH mpirun / mpiexec (hydra)"
    assert doctor.launcher({"OMPI_COMM_WORLD_SIZE": "4", "PMIX_RANK": "0", "PRTE_LAUNCHED": "1"}, 4) \
        == "Open MPI mpirun (prterun)"
    assert doctor.launcher({"OMPI_COMM_WORLD_SIZE": "4", "PMIX_RANK": "0"}, 4) == "Open MPI mpirun"
    assert doctor.launcher({}, 1) == "none (a single process)"


def test_open_mpi_4_mpirun_is_named_orterun_not_prterun():
    # the variables Debian's Open MPI 4.1.4 mpirun gives its ranks (measured): PMIx is there
    # too, but the runtime is ORTE; PRTE (PRTE_LAUNCHED) came with Open MPI 5
    env = {"OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": "0", "OMPI_MCA_orte_launch": "1"}
    assert doctor.launcher(env, 2) == "Open MPI mpirun (orterun)"
    assert set(env) <= set(doctor_probe.LAUNCH_ENV), "rank 0 must record the variables the rule reads"
    assert "PRTE_LAUNCHED" in doctor_probe.LAUNCH_ENV


def test_library_version_is_one_line_without_nul_bytes():
    # Open MPI 5's string as mpi4py returns it: the C string's terminating NUL included
    ompi = ("Open MPI v5.0.11, package: Open MPI distribution, ident: 5.0.11, repo rev: v5.0.11rc1, "
            "Sep 16, 2026\0")
    assert doctor_probe.library_line(ompi) == ompi[:-1]
    assert doctor_probe.library_line("MPICH Version:      5.0.2\nMPICH Release date: Fri\n") == "MPICH Version: 5.0.2"
    assert doctor_probe.library_line("\0\n") == "unknown"


# ---------------------------------------------------------------------------------- real runs

def _env(**extra):
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    env.update(extra)
    return env


@pytest.mark.mpi
@pytest.mark.openmpi
def test_doctor_under_mpirun_reports_world_hosts_and_versions(tmp_path):
    proc = mpirun(2, ["-m", "hpc_rlx.doctor", "--run-dir", str(tmp_path / "runs")], cwd=tmp_path,
                  env=_env(OMP_NUM_THREADS="1"), timeout=120)
    assert proc.returncode == 0, explain(proc)
    out = proc.stdout
    assert out.count("hpc_rlx doctor:") == 1, "only rank 0 prints"
    assert "2 rank(s) on 1 node(s)" in out
    assert "world size    2" in out
    assert EXPECTED_LAUNCHER[MPI_IMPL] in out and EXPECTED_LIBRARY[MPI_IMPL] in out, out
    assert "\0" not in out and not any(line != line.rstrip() for line in out.splitlines() if "library" in line)
    assert f"HDF5 {h5py.version.hdf5_version}" in out and f"h5py {h5py.__version__}" in out
    host = socket.gethostname().split(".")[0]
    row = next(line.split() for line in out.splitlines() if line.strip().startswith(host + " "))
    assert row[1:3] == ["0-1", "2"]
    assert "writable on every rank: yes" in out and "shared by all ranks: yes" in out
    assert "CUDA-aware" in out
    cores = len(os.sched_getaffinity(0))
    free = shm_free_bytes()
    if cores >= 2 and (free is None or largest_shared_bucket(free, 2) >= doctor.SHM_WARN_BUCKET):
        assert "No problems found." in out, out
    elif cores >= 2:      # a container's small /dev/shm: that is the one warning
        assert "Warnings (1)" in out and "/dev/shm has" in out, out
    # the probe files are cleaned up
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".hpc_rlx_doctor")] == []


@pytest.mark.mpi
def test_doctor_measures_the_real_dev_shm_it_runs_over(tmp_path):
    cmd = with_private_dev_shm("24m", launch_cmd(2, ["-m", "hpc_rlx.doctor", "--run-dir", str(tmp_path / "runs")]))
    proc = subprocess.run(cmd, env=mpi_env(_env(OMP_NUM_THREADS="1")), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    # the tmpfs is 24 MiB, less what the MPI library keeps there for itself
    line = next(line for line in proc.stdout.splitlines() if line.strip().startswith("/dev/shm"))
    free = int(line.split(":")[1].split()[0].replace(",", ""))
    assert 12 <= free <= 24, line
    assert f"! {socket.gethostname().split('.')[0]}: /dev/shm has {free} MiB free" in proc.stdout, proc.stdout


@pytest.mark.mpi
def test_doctor_warns_about_blas_oversubscription(tmp_path):
    cores = len(os.sched_getaffinity(0))
    threads = 2 * cores
    proc = mpirun(2, ["-m", "hpc_rlx.doctor", "--json"], cwd=tmp_path,
                  env=_env(OMP_NUM_THREADS=str(threads)), timeout=120)
    assert proc.returncode == 0, explain(proc)
    report = json.loads(proc.stdout)
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
    assert all(r["env"]["OMP_NUM_THREADS"] == str(threads) for r in ranks)
    assert any("oversubscribed" in w and f"OMP_NUM_THREADS={threads}" in w for w in report["warnings"]), \
        report["warnings"]


def _without_thread_vars() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in doctor.THREAD_ENV}
    env["PYTHONPATH"] = _env()["PYTHONPATH"]
    return env


def _doctor(n: int, args: list[str], cwd, env: dict) -> subprocess.CompletedProcess:
    cmd = launch_cmd(n, ["-m", "hpc_rlx.doctor"] + args)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.mpi
@pytest.mark.openmpi
def test_doctor_table_shows_training_threads_without_any_setting(tmp_path):
    cores = len(os.sched_getaffinity(0))
    proc = _doctor(2, [], tmp_path, _without_thread_vars())
    assert proc.returncode == 0, explain(proc)
    host = socket.gethostname().split(".")[0]
    row = next(line.split() for line in proc.stdout.splitlines() if line.strip().startswith(host + " "))
    per = max(1, cores // 2)
    assert row[4:6] == [str(per), str(2 * per)], proc.stdout
    assert "train.threads_per_rank unset: cores / ranks per node" in proc.stdout


@pytest.mark.mpi
@pytest.mark.openmpi
def test_doctor_takes_training_overrides_and_warns_about_threads_per_rank(tmp_path):
    cores = len(os.sched_getaffinity(0))
    proc = _doctor(2, [f"train.threads_per_rank={cores}", "--json"], tmp_path, _without_thread_vars())
    assert proc.returncode == 0, explain(proc)
    report = json.loads(proc.stdout)
    assert report["settings"]["threads_per_rank"] == cores
    assert [r["train_threads"] for r in report["ranks"]] == [cores, cores]
    assert any(f"train.threads_per_rank={cores} gives 2 ranks x {cores} threads" in w
               for w in report["warnings"]), report["warnings"]
    # a bad override: the training run's own message, once, and exit 2
    bad = _doctor(2, ["train.thread_per_rank=2"], tmp_path, _without_thread_vars())
    assert bad.returncode == 2, explain(bad)
    assert bad.stderr.count("unknown config key 'train.thread_per_rank'") == 1, explain(bad)
    assert "did you mean 'train.threads_per_rank'" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.mpi
def test_doctor_checks_the_training_data_file(tmp_path):
    missing = _doctor(2, ["data=file", f"data.path={tmp_path / 'nope.h5'}"], tmp_path, _without_thread_vars())
    assert missing.returncode == 0, explain(missing)
    assert f"! data file {tmp_path / 'nope.h5'} does not exist: the run would stop" in missing.stdout
    assert "No problems found" not in missing.stdout
    not_hdf5 = tmp_path / "notes.h5"
    not_hdf5.write_text("not HDF5")
    bad = _doctor(2, ["data=file", f"data.path={not_hdf5}"], tmp_path, _without_thread_vars())
    assert f"! data file {not_hdf5} cannot be opened as HDF5" in bad.stdout, explain(bad)
    unset = _doctor(2, ["data=file"], tmp_path, _without_thread_vars())
    assert unset.returncode == 2, explain(unset)
    assert unset.stderr.count("data=file needs data.path=<value>") == 1, explain(unset)


def test_ranks_whose_lanes_cannot_start_are_named_once_per_reason():
    recs = cluster({"n1": 2, "n2": 2})
    for r in recs:
        r["lanes_problem"] = "device=cuda but no GPU is usable on this rank (no GPU)" if r["host"] == "n2" else None
    (warning,) = doctor.analyse(recs)
    assert warning.startswith("the run would stop at start-up on ranks 2-3 (n2): device=cuda but no GPU")


@pytest.mark.mpi
def test_doctor_finds_that_device_cuda_has_no_gpu_here(tmp_path):
    """Training with device=cuda on a machine without a GPU stops at start-up with a
    DeviceError: the doctor, given the same override, says so instead of 'No problems found.'"""
    from hpc_rlx.base import backend
    if backend.gpu_count():
        pytest.skip("this machine has a GPU: device=cuda can start here")
    proc = _doctor(2, ["device=cuda"], tmp_path, _without_thread_vars())
    assert proc.returncode == 2, explain(proc)
    assert "No problems found" not in proc.stdout, proc.stdout
    lines = [ln for ln in proc.stdout.splitlines() if "device=cuda but no GPU is usable" in ln]
    assert len(lines) == 1 and lines[0].startswith("  ! the run would stop at start-up on ranks 0-1 ("), proc.stdout
    assert "use device=cpu" in lines[0] and "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and errors[0].startswith("hpc_rlx doctor: error (DeviceError): the run would stop"), \
        explain(proc)


@pytest.mark.mpi
def test_doctor_strict_fails_on_an_unwritable_run_dir(tmp_path):
    # /proc refuses new files even to root
    proc = mpirun(1, ["-m", "hpc_rlx.doctor", "--strict", "--run-dir", "/proc/hpc_rlx_outputs"],
                  cwd=tmp_path, env=_env(OMP_NUM_THREADS="1"), timeout=120)
    assert proc.returncode != 0, explain(proc)
    assert "cannot be written on ranks 0" in proc.stdout, explain(proc)
    assert "writable on every rank: NO" in proc.stdout
