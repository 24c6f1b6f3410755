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

import numpy as np
from scipy.linalg import blas as _blas

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
