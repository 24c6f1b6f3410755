"""8- and 4-bit codecs with per-group scales, for the outer syncs' wire
(``policy.outer_wire_dtype``); pure NumPy (no MPI).

They plug into the same owner scheme as the 16-bit codecs (`reduce.WireSum`): each segment's
owner decodes every rank's words, adds them in float32 in rank order and codes the sum once.
A block of ``n`` values is

    [ one float32 scale per group of `GROUP` values (2 words each) | the codes, packed ]

Codes are symmetric integers, ``q = rint(x / s)`` in ``[-QMAX, QMAX]`` with ``s`` the group's
largest magnitude over ``QMAX`` (so the largest value is exact and nothing clips); ``rint``
rounds half to even, so the same values code to the same words on every run and rank. int8
packs two codes per 16-bit word, int4 four. A group holding a NaN or an infinity gets a NaN
scale: it decodes to NaN, never to a finite lie.

What rounding loses is the caller's to keep: `reduce.FeedbackWireSum` carries it to the next
sync (error feedback).
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.comm.codec import CODECS, Codec
from hpc_rlx.base.errors import ConfigError

GROUP = 128          # values per scale: 1.6% (int8) or 3.1% (int4) of the words are scales
SCALE_WORDS = 2      # a float32 scale as two 16-bit words


class IntCodec(Codec):
    """Symmetric integer codes of ``bits`` bits, one float32 scale per `GROUP` values."""

    bits = 8
    qmax = 127

    def __init__(self, group: int = GROUP):
        self.group = int(group)
        self.per_word = 16 // self.bits

    def _groups(self, n: int) -> int:
        return -(-int(n) // self.group)

    def words(self, n: int) -> int:
        """Words a block of ``n`` values takes: the scales, then the packed codes."""
        return SCALE_WORDS * self._groups(n) + -(-int(n) // self.per_word)

    # ---- the math, on whole groups ------------------------------------------------------------
    def quantize(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(codes as int8, float32 scale per group) of the values ``x``."""
        x32 = np.asarray(x, dtype=np.float32).ravel()
        n, g = x32.size, self._groups(x32.size)
        padded = np.zeros(g * self.group, np.float32)
        padded[:n] = x32
        grouped = padded.reshape(g, self.group)
        with np.errstate(invalid="ignore"):
            peak = np.max(np.abs(grouped), axis=1)          # NaN or inf: the group is not finite
        finite = np.isfinite(peak)
        scales = np.where(finite, peak / np.float32(self.qmax), np.float32(np.nan)).astype(np.float32)
        safe = np.where(finite & (scales > 0), scales, np.float32(1.0))[:, None]
        codes = np.rint(np.where(finite[:, None], grouped, 0) / safe)
        np.clip(codes, -self.qmax, self.qmax, out=codes)
        return codes.astype(np.int8).ravel()[:n], scales

    def dequantize(self, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """float32 values of int8 ``codes`` under their groups' ``scales``."""
        n = codes.size
        padded = np.zeros(scales.size * self.group, np.float32)
        padded[:n] = codes
        grouped = padded.reshape(scales.size, self.group)
        grouped *= scales[:, None]
        return grouped.ravel()[:n].copy()

    # ---- packing into 16-bit words --------------------------------------------------------------
    def pack(self, codes: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def unpack(self, words: np.ndarray, n: int) -> np.ndarray:
        raise NotImplementedError

    # ---- the codec interface --------------------------------------------------------------------
    def encode(self, x: np.ndarray, out: np.ndarray) -> None:
        n = int(np.asarray(x).size)
        if out.size != self.words(n):
            raise ValueError(f"encode: {n} values need {self.words(n)} words, got {out.size}")
        codes, scales = self.quantize(x)
        head = SCALE_WORDS * scales.size
        out[:head] = scales.view(np.uint16)
        out[head:] = self.pack(codes)

    def decode(self, words: np.ndarray, n: int | None = None) -> np.ndarray:
        words = np.ascontiguousarray(words, dtype=np.uint16)
        # words = 2 g + ceil(n / per_word) with g = ceil(n / group); a block's size alone leaves
        # n open to the last word's padding, so the caller says n where it knows it
        n = self._values_in(words.size) if n is None else int(n)
        g = self._groups(n)
        scales = words[:SCALE_WORDS * g].view(np.float32)
        return self.dequantize(self.unpack(words[SCALE_WORDS * g:], n), scales)

    def _values_in(self, size: int) -> int:
        """The largest ``n`` a block of ``size`` words holds (`words` rounds up to whole words)."""
        per_group = SCALE_WORDS + self.group // self.per_word
        full, rest = divmod(int(size), per_group)
        if rest == 0:
            return full * self.group
        return full * self.group + (rest - SCALE_WORDS) * self.per_word


class Int8Codec(IntCodec):
    name = "int8"
    bits, qmax = 8, 127

    def pack(self, codes):
        pad = np.zeros(-(-codes.size // 2) * 2, np.int8)
        pad[:codes.size] = codes
        return pad.view(np.uint16)

    def unpack(self, words, n):
        return words.view(np.int8)[:n]


class Int4Codec(IntCodec):
    name = "int4"
    bits, qmax = 4, 7

    def pack(self, codes):
        nib = np.zeros(-(-codes.size // 4) * 4, np.uint16)
        nib[:codes.size] = codes.astype(np.int16).view(np.uint16) & 0xF
        nib = nib.reshape(-1, 4)
        return nib[:, 0] | (nib[:, 1] << 4) | (nib[:, 2] << 8) | (nib[:, 3] << 12)

    def unpack(self, words, n):
        shifts = np.array([0, 4, 8, 12], np.uint16)
        nib = ((words[:, None] >> shifts) & 0xF).astype(np.int8).ravel()[:n]
        return np.where(nib > 7, nib - 16, nib).astype(np.int8)


OUTER_WIRE_CODECS: dict[str, Codec] = {**CODECS, "int8": Int8Codec(), "int4": Int4Codec()}


def normalize_outer_wire(value) -> str | None:
    """``policy.outer_wire_dtype`` as None (the compute dtype) or one of `OUTER_WIRE_CODECS`."""
    if value is None:
        return None
    if isinstance(value, str):
        key = value.strip().lower()
        if key in ("", "null", "none"):
            return None
        if key in OUTER_WIRE_CODECS:
            return key
    raise ConfigError(f"policy.outer_wire_dtype must be null, {', '.join(OUTER_WIRE_CODECS)}; "
                      f"got {value!r}")


def outer_codec_for(value) -> Codec | None:
    """The codec ``policy.outer_wire_dtype`` asks for, or None (the compute dtype, uncoded)."""
    name = normalize_outer_wire(value)
    return None if name is None else OUTER_WIRE_CODECS[name]
