"""The CPU lanes' matrix products on another BLAS than NumPy's (`device.cpu_blas`).

- `numpy` (the default): NumPy's own BLAS, OpenBLAS in the PyPI wheels.
- `mkl`: Intel MKL's ``cblas_sgemm`` / ``cblas_dgemm`` through ctypes, from the `mkl` wheel
  (`pip install mkl`, or the `mkl` extra of hpc_rlx) or a site's ``libmkl_rt`` on the library
  path. On the Intel Xeon this was measured on, MKL's one-thread products of the MLP step
  took 0.73-0.82x the time of OpenBLAS's (`bench/bench_engine.py`, `bench/README.md`).

Only a 2-D product of two float32 (or two float64) matrices, each contiguous or the transpose
of a contiguous one (what the engine's linear and convolution GEMMs pass), goes to MKL; every
other product (batched, 1-D, integer, strided, empty) stays NumPy's. The two BLAS add in
different orders, so results differ in the last bits; with one BLAS a run repeats bitwise.

A CPU lane's executor gets `HostArrays(gemm)` as its array module: NumPy in every respect
but ``matmul``; `backend.is_host` tells it from a GPU module.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys

import numpy as np

from hpc_rlx.base.errors import ConfigError

CPU_BLAS = ("numpy", "mkl")

# CBLAS constants (cblas.h)
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
# mkl_set_threading_layer values (mkl_service.h)
_MKL_THREADING_INTEL, _MKL_THREADING_SEQUENTIAL = 0, 1


def _mkl_candidates() -> list[str]:
    """Where libmkl_rt may be: the `mkl` wheel puts it in the environment's lib directory."""
    found = []
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        found += sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
    name = ctypes.util.find_library("mkl_rt")
    if name:
        found.append(name)
    return found


class MklGemm:
    """MKL's GEMM for one process, with its threads set once (MKL's own thread pool, not
    threadpoolctl's: the sequential layer for one thread starts no OpenMP runtime)."""

    def __init__(self, threads: int = 1):
        errors = []
        for path in _mkl_candidates():
            try:
                lib = ctypes.CDLL(path)
                break
            except OSError as exc:
                errors.append(f"{path}: {exc}")
        else:
            tried = "; ".join(errors) or "no libmkl_rt in this environment or on the library path"
            raise ConfigError(f"device.cpu_blas=mkl needs Intel MKL: pip install mkl (or "
                              f"pip install 'hpc_rlx[mkl]'), or a site MKL on LD_LIBRARY_PATH ({tried})")
        threads = max(1, int(threads))
        # the layer must be chosen before MKL's first computation
        lib.MKL_Set_Threading_Layer(_MKL_THREADING_SEQUENTIAL if threads == 1 else _MKL_THREADING_INTEL)
        lib.MKL_Set_Num_Threads(threads)
        self.threads = threads
        self.path = path
        args = [ctypes.c_int] * 6
        self._gemm = {}
        for dtype, fn, scalar in ((np.float32, lib.cblas_sgemm, ctypes.c_float),
                                  (np.float64, lib.cblas_dgemm, ctypes.c_double)):
            fn.restype = None
            fn.argtypes = args + [scalar, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                  scalar, ctypes.c_void_p, ctypes.c_int]
            self._gemm[np.dtype(dtype)] = fn

    def matmul(self, a, b, out=None):
        """``a @ b`` (into ``out`` when given), on MKL where the operands allow, else NumPy's."""
        ta, lda = _operand(a)              # 0 unless a 2-D float matrix MKL can read as is
        tb, ldb = _operand(b)
        fn = self._gemm.get(a.dtype) if ta and tb and a.dtype == b.dtype else None
        if fn is not None:
            (m, k), n = a.shape, b.shape[1]
            fits = (b.shape[0] == k and 0 not in (m, k, n) and
                    (out is None or (out.shape == (m, n) and out.dtype == a.dtype and out.flags.c_contiguous
                                     and out.flags.writeable and not np.shares_memory(out, a)
                                     and not np.shares_memory(out, b))))
        if fn is None or not fits:        # NumPy's, which also buffers an aliased output itself
            return np.matmul(a, b) if out is None else np.matmul(a, b, out=out)
        if out is None:
            out = np.empty((m, n), dtype=a.dtype)
        fn(_ROW_MAJOR, ta, tb, m, n, k, 1.0, a.ctypes.data, lda, b.ctypes.data, ldb, 0.0, out.ctypes.data, n)
        return out


def _operand(a) -> tuple[int, int]:
    """(CBLAS transpose flag, leading dimension) of a row-major view of ``a``, or (0, 0) when
    ``a`` is neither contiguous nor the transpose of a contiguous matrix."""
    if a.ndim != 2 or a.dtype.kind != "f":
        return 0, 0
    if a.flags.c_contiguous:
        return _NO_TRANS, max(1, a.shape[1])
    if a.flags.f_contiguous:
        return _TRANS, max(1, a.shape[0])
    return 0, 0



class HostArrays:
    """NumPy for a CPU lane's executor, with ``matmul`` on ``gemm``."""

    __name__ = "numpy"
    host_module = True        # backend.is_host

    def __init__(self, gemm):
        self.gemm = gemm
        self.matmul = gemm.matmul

    def __getattr__(self, name):
        return getattr(np, name)


_MODULES: dict[tuple[str, int], object] = {}


def host_array_module(cpu_blas: str = "numpy", threads: int = 1):
    """The array module a CPU lane computes with: NumPy itself, or NumPy with MKL's GEMMs
    (one per setting and thread count in a process)."""
    if cpu_blas not in CPU_BLAS:
        raise ConfigError(f"device.cpu_blas must be one of {', '.join(CPU_BLAS)}, got {cpu_blas!r}")
    if cpu_blas == "numpy":
        return np
    key = (cpu_blas, max(1, int(threads)))
    if key not in _MODULES:
        _MODULES[key] = HostArrays(MklGemm(threads))
    return _MODULES[key]


def blas_note(cpu_blas: str, threads: int, lanes_spec) -> str:
    """What the start-up lane line adds about the CPU lanes' BLAS: nothing for NumPy's."""
    if cpu_blas == "numpy" or not any(kind == "cpu" for kind, _ in lanes_spec):
        return ""
    gemm = host_array_module(cpu_blas, threads).gemm
    return f" (matrix products on MKL: {gemm.path}, {gemm.threads} thread(s))"
