"""Is the MPI library CUDA-aware, and which way does a GPU bucket go through the Allreduce?

CUDA-aware MPI accepts device pointers: the bucket is summed where it lives (after the stream
is synchronised), over NVLink/IPC inside a node or GPUDirect RDMA between nodes. Any other
MPI would read device pointers as host memory and crash or corrupt, so then the bucket is
staged through page-locked host memory, allocated once.

The library is asked through ``MPIX_Query_cuda_support()`` (Open MPI's CUDA extension and
MPICH 4+ both export it; it reports the runtime state, e.g. MPICH answers 0 unless
MPIR_CVAR_ENABLE_GPU is on and it was built with CUDA). ``comm.cuda_aware`` overrides it:
``auto`` trusts the query, ``true`` forces the direct path (for libraries that lack the query
but are CUDA-aware), ``false`` forces staging.

This module loads the library with ctypes only: no CuPy import, no MPI call.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from hpc_rlx.base.errors import ConfigError

SETTINGS = ("auto", "true", "false")

# The bucket paths, as logged and as the doctor reports them.
HOST = "host"                 # no GPU lane: the bucket is a host array
DIRECT = "cuda-aware"         # Allreduce on the CuPy bucket itself
STAGED = "staged"             # device bucket -> pinned host copy -> Allreduce -> back


def normalize_setting(value) -> str:
    """``comm.cuda_aware`` as one of auto/true/false (YAML gives booleans for true/false)."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and value.strip().lower() in SETTINGS:
        return value.strip().lower()
    if isinstance(value, str) and value.strip().lower() in ("yes", "no", "on", "off", "1", "0"):
        return "true" if value.strip().lower() in ("yes", "on", "1") else "false"
    raise ConfigError(f"comm.cuda_aware must be one of auto, true, false; got {value!r}")


def mpi_library_paths() -> list[str]:
    """Paths of the MPI shared libraries mapped into this process (after mpi4py loaded one)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                path = fields[-1] if len(fields) >= 6 else ""
                name = os.path.basename(path)
                if name.startswith(("libmpi.", "libmpi_", "libmpich")) and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def query_cuda_support() -> tuple[str, str]:
    """("yes" | "no" | "unknown", how we know), from MPIX_Query_cuda_support in the loaded MPI."""
    handles = []
    for path in mpi_library_paths():
        try:
            handles.append((path, ctypes.CDLL(path)))
        except OSError:
            continue
    try:
        handles.append(("process symbols", ctypes.CDLL(None)))
    except OSError:
        pass
    for where, lib in handles:
        fn = getattr(lib, "MPIX_Query_cuda_support", None)
        if fn is None:
            continue
        fn.restype, fn.argtypes = ctypes.c_int, []
        value = int(fn())
        return ("yes" if value else "no"), f"MPIX_Query_cuda_support() = {value} in {where}"
    return "unknown", "the MPI library has no MPIX_Query_cuda_support"


@dataclass(frozen=True)
class PathChoice:
    """Where the bucket goes through the Allreduce, and why (one line for the log)."""

    path: str
    reason: str

    @property
    def direct(self) -> bool:
        return self.path == DIRECT

    def describe(self) -> str:
        return f"{self.path} ({self.reason})"


def choose_path(setting, bucket_on_device: bool, query=query_cuda_support,
                wire_dtype: str | None = None, deterministic: bool = False) -> PathChoice:
    """The bucket path for this rank. ``query`` is injectable for tests."""
    mode = normalize_setting(setting)
    if not bucket_on_device:
        return PathChoice(HOST, "no GPU lane on this rank")
    if wire_dtype:
        # The float32 accumulation of the compressed wire is a host-side reduction.
        return PathChoice(STAGED, f"comm.wire_dtype={wire_dtype} reduces on the host")
    if deterministic:
        return PathChoice(STAGED, "comm.deterministic=true sums in rank order on the host")
    if mode == "false":
        return PathChoice(STAGED, "comm.cuda_aware=false")
    answer, how = query()
    if mode == "true":
        note = "" if answer == "yes" else f"; the library says {answer}: {how}"
        return PathChoice(DIRECT, f"comm.cuda_aware=true{note}")
    if answer == "yes":
        return PathChoice(DIRECT, how)
    return PathChoice(STAGED, f"MPI is not known to be CUDA-aware: {how}")


def doctor_summary(gpus: int | None, answer: str, how: str) -> str:
    """The doctor's line: which path a run with GPU lanes would take here (comm.cuda_aware=auto)."""
    if not gpus:
        return f"{HOST} (no GPU visible: the bucket stays in host memory)"
    if answer == "yes":
        return f"{DIRECT}: Allreduce on the GPU bucket ({how}); comm.cuda_aware=false forces staging"
    return (f"{STAGED}: GPU bucket copied through pinned host memory ({how}); "
            "comm.cuda_aware=true forces the direct path if you know better")
