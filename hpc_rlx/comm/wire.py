"""The compressed wire format of the gradient payload: bfloat16 or float16 words, float32 sums.

Pure array math (no MPI): ``comm.FusedBucket`` moves these words with Alltoallv/Allgatherv.

MPI has no bfloat16 type and no SUM for 16-bit floats on host buffers, and a user-defined op
would round every partial sum of a tree or ring back to 16 bits. Instead each rank owns one
segment of the payload: every rank sends its 16-bit coded slice of that segment to the owner,
the owner decodes all of them and adds them in float32 in rank order, codes the sum once and
sends it to everyone. Two roundings per element in all (the inputs and the sum), half the
bytes of a float32 ring allreduce, and every rank ends with identical bits.

A block on the wire is ``[scale: float32 as 2 words | n coded words]``. The scale is a power
of two (exact to apply): 1 for bfloat16 (float32's exponent range), and for float16 the one
that brings the block's largest finite magnitude near 2**14, so gradients neither overflow
65504 nor sink into float16's subnormals.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.errors import ConfigError

WIRE_DTYPES = ("bfloat16", "float16")
HEADER_WORDS = 2                 # the float32 scale
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
_F16_TARGET_EXP = 14             # largest magnitude scaled to [2**13, 2**14]: far below 65504

_ALIASES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
            "half": "float16"}


def normalize_wire(value) -> str | None:
    """``comm.wire_dtype`` as None (off) or one of WIRE_DTYPES."""
    if value is None:
        return None
    if isinstance(value, str):
        key = value.strip().lower()
        if key in ("", "null", "none", "off", "float32", "fp32"):
            return None
        if key in _ALIASES:
            return _ALIASES[key]
    raise ConfigError(f"comm.wire_dtype must be null, bfloat16 or float16; got {value!r}")


# ---- bfloat16 bit conversions ---------------------------------------------------------

def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 words, rounding to nearest even; NaN stays a (quiet) NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def bf16_bits_to_f32(w: np.ndarray) -> np.ndarray:
    """bfloat16 words -> float32 (exact)."""
    return (np.ascontiguousarray(w, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


# ---- blocks -------------------------------------------------------------------------

def block_scale(x: np.ndarray, codec: str) -> float:
    """The power-of-two factor applied before coding ``x`` (see the module docstring)."""
    if codec == "bfloat16" or x.size == 0:
        return 1.0
    finite = np.abs(x[np.isfinite(x)])
    peak = float(finite.max()) if finite.size else 0.0
    if peak == 0.0:
        return 1.0
    _, exp = np.frexp(peak)                          # peak in [2**(exp-1), 2**exp)
    k = int(np.clip(_F16_TARGET_EXP - int(exp), -120, 120))
    return float(2.0 ** k)


def block_words(n: int) -> int:
    """Words a block of ``n`` values takes on the wire."""
    return HEADER_WORDS + int(n)


def pack_block(x: np.ndarray, codec: str, out: np.ndarray) -> None:
    """Code ``x`` (any float dtype) into ``out`` (uint16, ``block_words(x.size)`` long)."""
    n = x.size
    if out.size != block_words(n):
        raise ValueError(f"pack_block: {n} values need {block_words(n)} words, got {out.size}")
    x32 = np.asarray(x, dtype=np.float32)
    scale = block_scale(x32, codec)
    out[:HEADER_WORDS] = np.array([scale], dtype=np.float32).view(np.uint16)
    if n == 0:
        return
    scaled = x32 * np.float32(scale) if scale != 1.0 else x32
    if codec == "bfloat16":
        out[HEADER_WORDS:] = f32_to_bf16_bits(scaled)
    elif codec == "float16":
        out[HEADER_WORDS:] = scaled.astype(np.float16).view(np.uint16)
    else:
        raise ValueError(f"unknown wire codec {codec!r}")


def unpack_block(words: np.ndarray, codec: str) -> np.ndarray:
    """The float32 values of a block (a new array)."""
    scale = float(np.ascontiguousarray(words[:HEADER_WORDS]).view(np.float32)[0])
    body = np.ascontiguousarray(words[HEADER_WORDS:])
    if codec == "bfloat16":
        vals = bf16_bits_to_f32(body)
    elif codec == "float16":
        vals = body.view(np.float16).astype(np.float32)
    else:
        raise ValueError(f"unknown wire codec {codec!r}")
    if scale != 1.0:
        vals *= np.float32(1.0 / scale)
    return vals


def segments(n: int, parts: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into ``parts`` contiguous, nearly equal ranges (some empty when n < parts)."""
    base, extra = divmod(int(n), int(parts))
    out, lo = [], 0
    for k in range(parts):
        hi = lo + base + (1 if k < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def error_bound(codec: str, abs_sum, result, ranks: int, peak: float = 0.0) -> np.ndarray:
    """An upper bound of |wire sum - exact sum| per element, given sum_i |x_i| (``abs_sum``):
    one rounding of every input and one of the sum (unit roundoff u of the codec), the float32
    additions at the owner, and the absolute error of subnormals: bfloat16's (2**-134), or for
    float16 the one below a block whose largest magnitude is at most ``peak`` (2**-25 after
    scaling it to ~2**14)."""
    u = UNIT_ROUNDOFF[codec]
    acc = ranks * 2.0 ** -24
    floor = (ranks + 1) * (float(peak) * 2.0 ** -37 if codec == "float16" else 2.0 ** -134)
    return (u + acc) * np.asarray(abs_sum, np.float64) + u * np.abs(np.asarray(result, np.float64)) + floor
