"""Whether an array holds only finite values, at the cost of one read pass (the bucket checks
its gradients every step). Pure NumPy."""

from __future__ import annotations

import math

import numpy as np

_FINITE_BLOCK = 1 << 16


def all_finite(x: np.ndarray) -> bool:
    """``np.isfinite(x).all()`` at the cost of one read pass: a NaN or an infinity makes the dot
    product x.x non-finite, so a finite one proves every value finite. Only a non-finite dot
    product (a bad value, or finite values too large to square) takes the exact check."""
    flat = x.reshape(-1)
    if flat.dtype.kind == "f" and flat.flags.c_contiguous:
        with np.errstate(over="ignore", invalid="ignore"):
            if math.isfinite(float(np.dot(flat, flat))):
                return True
    return finite_blockwise(flat)


def finite_blockwise(flat: np.ndarray) -> bool:
    """The exact check: isfinite in cache-sized blocks into one small mask (no temporary as
    large as the gradient), stopping at the first bad block."""
    mask = np.empty(min(flat.size, _FINITE_BLOCK), dtype=bool)
    for lo in range(0, flat.size, _FINITE_BLOCK):
        part = flat[lo: lo + _FINITE_BLOCK]
        view = mask[: part.size]
        np.isfinite(part, out=view)
        if not view.all():
            return False
    return True
