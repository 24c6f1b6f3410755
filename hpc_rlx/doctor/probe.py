"""The doctor's local facts: what one rank finds about its node, its software and its run
directory (no collective here; `doctor` gathers the records and analyses them)."""

from __future__ import annotations

import glob
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy
from threadpoolctl import threadpool_info

from hpc_rlx.base.version import __version__
from hpc_rlx.comm.node_memory import shm_free_bytes
from hpc_rlx.data.files import resolve
from hpc_rlx.base import backend
from hpc_rlx.base.cuda_mpi import query_cuda_support
from hpc_rlx.device.lane_plan import assign_gpus, resolve_lanes
from hpc_rlx.doctor.threads import THREAD_ENV
from hpc_rlx.base.errors import DataError, HpcRlxError

SLURM_ENV = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_CPUS_PER_TASK", "SLURM_JOB_NODELIST",
             "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_MPI_TYPE", "SLURM_RESTART_COUNT")
# PRTE_LAUNCHED: Open MPI 5's runtime (PRRTE); OMPI_MCA_orte_launch: Open MPI 4's (ORTE)
LAUNCH_ENV = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "HYDI_CONTROL_FD",
              "PRTE_LAUNCHED", "OMPI_MCA_orte_launch")
# Facts that must agree on every rank: a mix means nodes run different software.
SOFTWARE_KEYS = ("python", "numpy", "h5py", "hdf5", "mpi4py", "mpi_library", "hpc_rlx")


def safe_call(fn, default=None):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a probe that fails is reported, never fatal
        return default if default is not None else f"unknown ({type(exc).__name__}: {exc})"


def usable_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def blas_pools() -> list[dict]:
    """BLAS/OpenMP thread pools loaded in this process (NumPy's BLAS at least)."""
    import numpy  # noqa: F401 - loads the BLAS so that threadpoolctl can see it

    return [{"api": p.get("internal_api"), "version": p.get("version"),
             "threads": int(p.get("num_threads") or 1), "layer": p.get("threading_layer")}
            for p in threadpool_info()]


def cuda_aware_mpi() -> tuple[str, str]:
    """("yes" | "no" | "unknown", how we know), from MPIX_Query_cuda_support in the loaded MPI
    (the same probe the training run uses to pick its bucket path)."""
    return query_cuda_support()


def visible_gpus() -> tuple[int | None, str]:
    """How many GPUs this rank can use, and where the number comes from."""
    try:
        if backend.cupy_available():
            return int(backend.gpu_count()), "CuPy"
        cupy_note = "CuPy sees none"
    except Exception as exc:  # noqa: BLE001
        cupy_note = f"CuPy unavailable ({type(exc).__name__})"
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=15)
            n = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
            if cvd is not None:
                n = min(n, len([d for d in cvd.split(",") if d.strip() and d.strip() != "-1"]))
            return n, f"nvidia-smi -L ({cupy_note})"
        except (OSError, subprocess.TimeoutExpired):
            pass
    if cvd:
        return None, f"CUDA_VISIBLE_DEVICES={cvd}, no nvidia-smi ({cupy_note})"
    return 0, f"no nvidia-smi ({cupy_note})"


def gpu_check(local_rank: int) -> dict | None:
    """Run a kernel, a GEMM and a pinned copy on the GPU this rank would train on
    (``device.gpus_per_rank=1``); None when CuPy sees no GPU."""
    if not backend.cupy_available():
        return None
    index = assign_gpus(backend.gpu_count(), 1, local_rank)[0]
    return {"index": index, "physical": backend.physical_gpu(index), "problem": backend.smoke_test(index)}


def lane_problem(settings: dict, local_rank: int) -> str | None:
    """Why this rank's lanes could not start under the run's device settings (device=cuda on a
    rank without a GPU), in training's own words; None when they would. The same decision
    training takes at start-up (`resolve_lanes`), so the doctor finds what the run will hit."""
    if "device_kind" not in settings:
        return None
    try:
        resolve_lanes(settings["device_kind"], int(settings["cpu_lanes"]),
                      settings["gpus_per_rank"], local_rank)
    except HpcRlxError as exc:
        return str(exc)
    return None


def nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def data_file_problem(path: str) -> str | None:
    """None if `path` (a file, a directory of HDF5 files or a glob, as data.path takes) opens as
    HDF5 here, else why not (in words). Of many files, the first and the last are opened."""
    if not glob.has_magic(path) and not Path(path).exists():
        return "does not exist"
    try:
        paths = resolve(path)
    except DataError as e:        # "data.path=<path> matches no file": the words after the path
        return str(e).removeprefix(f"data.path={path}").lstrip(":").strip()
    for p in dict.fromkeys((paths[0], paths[-1])):
        try:
            with h5py.File(p, "r"):
                pass
        except OSError as exc:
            return (f"cannot be opened as HDF5 ({exc})" if len(paths) == 1
                    else f"holds {p}, which cannot be opened as HDF5 ({exc})")
    return None


def writable(directory: Path) -> tuple[bool, str]:
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".hpc_rlx_doctor_"):
            pass
        return True, ""
    except OSError as exc:
        return False, f"{type(exc).__name__}: {exc.strerror or exc}"


def software() -> dict:


    info = {"python": platform.python_version(), "executable": sys.executable,
            "numpy": numpy.__version__, "h5py": h5py.__version__,
            "hdf5": h5py.version.hdf5_version, "hpc_rlx": __version__,
            "h5py_mpi": bool(safe_call(lambda: h5py.get_config().mpi, False))}
    info["hydra"] = safe_call(lambda: __import__("hydra").__version__)
    return info


def library_line(version: str) -> str:
    """The first line of MPI_Get_library_version, whitespace collapsed, without NUL bytes
    (Open MPI 5 counts its string's terminating NUL in the length, so it reaches Python)."""
    lines = version.replace("\0", "").strip().splitlines()
    return " ".join(lines[0].split()) if lines else "unknown"


def mpi_facts(comm) -> dict:
    import mpi4py
    from mpi4py import MPI

    level = MPI.Query_thread()
    names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
             MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    aware, how = safe_call(cuda_aware_mpi, ("unknown", "probe failed"))
    return {"mpi4py": mpi4py.__version__,
            "mpi_library": library_line(MPI.Get_library_version()),
            "mpi_standard": "%d.%d" % MPI.Get_version(), "thread_level": names.get(level, str(level)),
            "processor": MPI.Get_processor_name(), "cuda_aware": aware, "cuda_aware_how": how}


def collect_local(rank: int, size: int, run_dir: Path) -> dict:
    cores = usable_cores()
    rec = {"rank": rank, "size": size, "host": socket.gethostname().split(".")[0],
           "pid": os.getpid(), "cpu_count": os.cpu_count() or 1, "cores": cores,
           "env": {k: os.environ[k] for k in THREAD_ENV + SLURM_ENV + LAUNCH_ENV if k in os.environ}}
    pools = safe_call(blas_pools, [])
    rec["blas"] = pools if isinstance(pools, list) else []
    rec["blas_threads"] = max([p["threads"] for p in rec["blas"]] or [1])
    rec["gpus"], rec["gpus_how"] = safe_call(visible_gpus, (None, "probe failed"))
    rec["shm_free"] = safe_call(shm_free_bytes, None)
    sw = safe_call(software, {})
    rec.update(sw if isinstance(sw, dict) else {})
    base = nearest_existing(run_dir)
    ok, why = writable(base)
    rec["run_dir"] = {"path": str(run_dir.absolute()), "exists": run_dir.exists(),
                      "checked": str(base), "writable": ok, "why": why}
    return rec
