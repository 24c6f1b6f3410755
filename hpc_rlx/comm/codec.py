"""The 16-bit codecs of the gradient wire: one `Codec` per wire dtype, pure NumPy (no MPI).

A codec turns float values into 16-bit words and back, and adds decoded blocks in float32
(the widening accumulation: the sum of 16-bit inputs is formed in float32 and rounded once,
when it is coded again). Which ranks send which words to whom is a reduction path's business
(`reduce.WireSum`: a reduce-scatter + allgather); any path may take a codec
(`reduce.ReductionPath.takes_codec`).

A block on the wire is ``[scale: float32 as 2 words | n coded words]``. The scale is a power
of two (exact to apply): 1 for bfloat16 (float32's exponent range), and for float16 the one
that brings the block's largest finite magnitude near 2**14, so gradients neither overflow
65504 nor sink into float16's subnormals.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from hpc_rlx.base.errors import ConfigError

HEADER_WORDS = 2                 # the float32 scale
_F16_TARGET_EXP = 14             # largest magnitude scaled to [2**13, 2**14]: far below 65504

_ALIASES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
            "half": "float16"}


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


# ---- the codecs -----------------------------------------------------------------------

class Codec:
    """One 16-bit wire format. Subclasses say how float32 values become words and back
    (`to_words`, `from_words`), the block's scale (`scale`), the unit roundoff and the
    absolute error of the format's subnormals (`subnormal_floor`)."""

    name = ""
    unit_roundoff = 0.0
    accumulator = np.float32     # decoded blocks are added in this dtype

    # ---- what a format says -------------------------------------------------------------
    def scale(self, x32: np.ndarray) -> float:
        """The power-of-two factor applied to a block before coding it."""
        return 1.0

    def to_words(self, scaled: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def from_words(self, body: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def subnormal_floor(self, peak: float) -> float:
        """The absolute error of one rounding near zero, for a block whose largest magnitude
        is at most ``peak``."""
        raise NotImplementedError

    # ---- blocks ---------------------------------------------------------------------------
    @staticmethod
    def words(n: int) -> int:
        """Words a block of ``n`` values takes on the wire."""
        return HEADER_WORDS + int(n)

    def encode(self, x: np.ndarray, out: np.ndarray) -> None:
        """Code ``x`` (any float dtype) into ``out`` (uint16, ``words(x.size)`` long)."""
        n = x.size
        if out.size != self.words(n):
            raise ValueError(f"pack_block: {n} values need {self.words(n)} words, got {out.size}")
        x32 = np.asarray(x, dtype=np.float32)
        scale = self.scale(x32)
        out[:HEADER_WORDS] = np.array([scale], dtype=np.float32).view(np.uint16)
        if n == 0:
            return
        scaled = x32 * np.float32(scale) if scale != 1.0 else x32
        out[HEADER_WORDS:] = self.to_words(scaled)

    def decode(self, words: np.ndarray, n: int | None = None) -> np.ndarray:
        """The float32 values of a block (a new array); ``n``, its values, where the caller
        knows it (a 16-bit block's size says it)."""
        scale = float(np.ascontiguousarray(words[:HEADER_WORDS]).view(np.float32)[0])
        vals = self.from_words(np.ascontiguousarray(words[HEADER_WORDS:]))
        if scale != 1.0:
            vals *= np.float32(1.0 / scale)
        return vals

    def round_trip(self, x: np.ndarray) -> np.ndarray:
        """What the far side decodes of ``x``: decode(encode(x)), in float32."""
        n = int(np.asarray(x).size)
        out = np.empty(self.words(n), np.uint16)
        self.encode(x, out)
        return self.decode(out, n)

    def sum_blocks(self, blocks: Iterable[np.ndarray], n: int) -> np.ndarray:
        """Decode blocks of ``n`` values each and add them in float32, in the order given
        (rank order: the same sum on every run)."""
        total = np.zeros(n, self.accumulator)
        for block in blocks:
            total += self.decode(block, n)
        return total

    def error_bound(self, abs_sum, result, ranks: int, peak: float = 0.0) -> np.ndarray:
        """An upper bound of |wire sum - exact sum| per element, given sum_i |x_i| (``abs_sum``):
        one rounding of every input and one of the sum (unit roundoff u), the float32 additions
        at the owner, and the absolute error of subnormals (`subnormal_floor`)."""
        u = self.unit_roundoff
        acc = ranks * 2.0 ** -24
        floor = (ranks + 1) * self.subnormal_floor(peak)
        return (u + acc) * np.asarray(abs_sum, np.float64) + u * np.abs(np.asarray(result, np.float64)) + floor


class BFloat16Codec(Codec):
    """bfloat16: float32's exponent range, 8 bits of precision; no scaling needed."""

    name = "bfloat16"
    unit_roundoff = 2.0 ** -8

    def to_words(self, scaled: np.ndarray) -> np.ndarray:
        return f32_to_bf16_bits(scaled)

    def from_words(self, body: np.ndarray) -> np.ndarray:
        return bf16_bits_to_f32(body)

    def subnormal_floor(self, peak: float) -> float:
        return 2.0 ** -134


class Float16Codec(Codec):
    """float16: 11 bits of precision, a block scale that keeps values inside its range."""

    name = "float16"
    unit_roundoff = 2.0 ** -11

    def scale(self, x32: np.ndarray) -> float:
        if x32.size == 0:
            return 1.0
        finite = np.abs(x32[np.isfinite(x32)])
        peak = float(finite.max()) if finite.size else 0.0
        if peak == 0.0:
            return 1.0
        _, exp = np.frexp(peak)                          # peak in [2**(exp-1), 2**exp)
        k = int(np.clip(_F16_TARGET_EXP - int(exp), -120, 120))
        return float(2.0 ** k)

    def to_words(self, scaled: np.ndarray) -> np.ndarray:
        return scaled.astype(np.float16).view(np.uint16)

    def from_words(self, body: np.ndarray) -> np.ndarray:
        return body.view(np.float16).astype(np.float32)

    def subnormal_floor(self, peak: float) -> float:
        return float(peak) * 2.0 ** -37           # 2**-25 after scaling the peak to ~2**14


CODECS: dict[str, Codec] = {c.name: c for c in (BFloat16Codec(), Float16Codec())}


def codec_named(name: str) -> Codec:
    """The codec of a wire dtype name (one of `CODECS`)."""
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown wire codec {name!r}") from None


def normalize_wire(value) -> str | None:
    """``comm.wire_dtype`` as None (off) or one of the codecs' names."""
    if value is None:
        return None
    if isinstance(value, str):
        key = value.strip().lower()
        if key in ("", "null", "none", "off", "float32", "fp32"):
            return None
        if key in _ALIASES:
            return _ALIASES[key]
    raise ConfigError(f"comm.wire_dtype must be null, bfloat16 or float16; got {value!r}")


def codec_for(value) -> Codec | None:
    """The codec ``comm.wire_dtype`` asks for, or None (no 16-bit wire)."""
    name = normalize_wire(value)
    return None if name is None else CODECS[name]
