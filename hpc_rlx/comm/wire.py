"""The compressed wire of the gradient payload: bfloat16 or float16 words, float32 sums.

Pure array math (no MPI). The formats themselves are `hpc_rlx.comm.codec` (one `Codec` per
wire dtype); `reduce.WireSum` moves their words with Alltoallv/Allgatherv. This module names
them by wire dtype, as the config does (the ranks' segments are `base.even_split`).

MPI has no bfloat16 type and no SUM for 16-bit floats on host buffers, and a user-defined op
would round every partial sum of a tree or ring back to 16 bits. Instead each rank owns one
segment of the payload: every rank sends its 16-bit coded slice of that segment to the owner,
the owner decodes all of them and adds them in float32 in rank order, codes the sum once and
sends it to everyone. Two roundings per element in all (the inputs and the sum), half the
bytes of a float32 ring allreduce, and every rank ends with identical bits.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.comm.codec import (CODECS, HEADER_WORDS, Codec, bf16_bits_to_f32, codec_named,
                                f32_to_bf16_bits, normalize_wire)

__all__ = ["WIRE_DTYPES", "UNIT_ROUNDOFF", "HEADER_WORDS", "f32_to_bf16_bits", "bf16_bits_to_f32",
           "normalize_wire", "block_scale", "block_words", "pack_block", "unpack_block",
           "error_bound"]

WIRE_DTYPES = tuple(CODECS)
UNIT_ROUNDOFF = {name: codec.unit_roundoff for name, codec in CODECS.items()}


def block_scale(x: np.ndarray, codec: str) -> float:
    """The power-of-two factor applied before coding ``x`` (see `hpc_rlx.comm.codec`)."""
    return codec_named(codec).scale(np.asarray(x))


def block_words(n: int) -> int:
    """Words a block of ``n`` values takes on the wire."""
    return Codec.words(n)


def pack_block(x: np.ndarray, codec: str, out: np.ndarray) -> None:
    """Code ``x`` (any float dtype) into ``out`` (uint16, ``block_words(x.size)`` long)."""
    codec_named(codec).encode(x, out)


def unpack_block(words: np.ndarray, codec: str) -> np.ndarray:
    """The float32 values of a block (a new array)."""
    return codec_named(codec).decode(words)



def error_bound(codec: str, abs_sum, result, ranks: int, peak: float = 0.0) -> np.ndarray:
    """An upper bound of |wire sum - exact sum| per element (`codec.Codec.error_bound`): one
    rounding of every input and one of the sum, the float32 additions at the owner, and the
    absolute error of subnormals: bfloat16's (2**-134), or for float16 the one below a block
    whose largest magnitude is at most ``peak`` (2**-25 after scaling it to ~2**14)."""
    return codec_named(codec).error_bound(abs_sum, result, ranks, peak)
