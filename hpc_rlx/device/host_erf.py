"""A float32 error function on the host that runs at NumPy's vector speed.

SciPy's ``erf`` evaluates float32 arrays one number at a time in double precision: about 17 ns
a value here, ten times PyTorch's, and the whole cost of an exact GELU (ViT, BERT, ConvNeXt,
Swin, MLP-Mixer). ``erf_float32`` evaluates the Chebyshev fit of erfc from Numerical Recipes
(Press et al., 2nd ed., section 6.2; fractional error below 1.2e-7 for every argument) with
in-place ufuncs over cache-sized chunks, so each of its ~30 passes reads cache, not memory.
The result is within 5e-7 of the exact erf everywhere (absolute: a few of float32's spacings
near 1, 6e-8; erf(x) for |x| below about 1e-6 comes out as 0), where a model uses it as GELU's
1 + erf(x / sqrt 2). Float64 keeps SciPy's exact erf.
"""

from __future__ import annotations

import numpy as np

# erfc(z) = t * exp(-z^2 + P(t)), t = 1 / (1 + z / 2), for z >= 0; P's coefficients from t^0 up
_ERFC_POLY = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
              0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277)
_CHUNK = 1 << 16  # values per pass: three float32 work arrays of 256 KiB stay in L2 (best of 8K-2M here)


def _erf_flat(x, out) -> None:
    """erf of the 1-D float32 ``x`` into ``out`` (same length), chunk by chunk."""
    z, t, p = (np.empty(min(_CHUNK, x.size), np.float32) for _ in range(3))
    coeffs = [np.float32(c) for c in reversed(_ERFC_POLY)]
    for start in range(0, x.size, _CHUNK):
        xs, n = x[start:start + _CHUNK], min(_CHUNK, x.size - start)
        zc, tc, pc = z[:n], t[:n], p[:n]
        np.abs(xs, out=zc)
        np.multiply(zc, np.float32(0.5), out=tc)
        tc += np.float32(1.0)
        np.divide(np.float32(1.0), tc, out=tc)
        np.multiply(tc, coeffs[0], out=pc)
        for c in coeffs[1:-1]:
            pc += c
            pc *= tc
        pc += coeffs[-1]
        np.multiply(zc, zc, out=zc)
        np.subtract(pc, zc, out=pc)
        np.exp(pc, out=pc)
        pc *= tc  # erfc(|x|)
        np.subtract(np.float32(1.0), pc, out=pc)
        np.copysign(pc, xs, out=out[start:start + n])


def erf_float32(x: np.ndarray) -> np.ndarray:
    """erf of a float32 array, in a new array of the same shape and memory order."""
    out = np.empty_like(x)
    flat_in, flat_out = x.ravel(order="K"), out.ravel(order="K")
    if not np.shares_memory(flat_out, out) or (x.strides != out.strides):
        # an irregular view: work on copies in C order
        flat_in = np.ascontiguousarray(x).ravel()
        result = np.empty_like(flat_in)
        _erf_flat(flat_in, result)
        return result.reshape(x.shape)
    _erf_flat(flat_in, flat_out)
    return out
