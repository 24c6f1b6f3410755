"""In-place BLAS level-1 updates on flat NumPy arrays: ``y += a * x`` and ``x *= a`` in one pass
over memory each.

NumPy has no fused multiply-add over arrays, so ``p -= lr * buf`` costs two passes and a
scratch array; an optimizer step over a few million parameters is bound by memory traffic,
and BLAS ``axpy`` halves it. SciPy's BLAS wrappers (SciPy ships with scikit-learn, a
dependency) update ``y`` in place when it is contiguous and of the routine's dtype; anything
else (CuPy arrays, other dtypes, strided views) has no fused form here and the caller keeps its
plain NumPy/CuPy expression.
"""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import os

import numpy as np


def _load_fblas():
    """SciPy's compiled BLAS wrappers (``scipy.linalg._fblas``) without ``import scipy.linalg``,
    which executes the whole of scipy.linalg and its array-API shims: about half a second of
    every rank's start-up for four routines. Any surprise in SciPy's layout falls back to the
    public module."""
    try:
        scipy_dir = os.path.dirname(importlib.util.find_spec("scipy").origin)
        (path,) = glob.glob(os.path.join(scipy_dir, "linalg", "_fblas.*"))
        loader = importlib.machinery.ExtensionFileLoader("scipy.linalg._fblas", path)
        module = importlib.util.module_from_spec(
            importlib.util.spec_from_file_location("scipy.linalg._fblas", path, loader=loader))
        loader.exec_module(module)
        return module
    except Exception:  # noqa: BLE001 - the public import is always right, only slower
        from scipy.linalg import blas
        return blas


_blas = _load_fblas()
_AXPY = {np.dtype(np.float32): _blas.saxpy, np.dtype(np.float64): _blas.daxpy}
_SCAL = {np.dtype(np.float32): _blas.sscal, np.dtype(np.float64): _blas.dscal}


def fusable(*arrays) -> bool:
    """Whether every array is a contiguous 1-D NumPy float32/float64 array of one dtype."""
    first = arrays[0]
    return all(isinstance(a, np.ndarray) and a.ndim == 1 and a.flags.c_contiguous and a.dtype == first.dtype
               and a.dtype in _AXPY for a in arrays)


def axpy(a: float, x: np.ndarray, y: np.ndarray) -> None:
    """``y += a * x`` in place (one fused multiply-add per element)."""
    out = _AXPY[y.dtype](x, y, n=y.size, a=a)
    if out is not y and not np.shares_memory(out, y):   # the wrapper copied: keep the contract
        y[...] = out


def scal(a: float, x: np.ndarray) -> None:
    """``x *= a`` in place."""
    out = _SCAL[x.dtype](a, x, n=x.size)
    if out is not x and not np.shares_memory(out, x):
        x[...] = out
