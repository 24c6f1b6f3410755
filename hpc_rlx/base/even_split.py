"""A vector cut into nearly equal contiguous ranges: the wire's owner segments, a sharded
optimizer's slices, the fragments of a windowed sync and a rank's lanes all cut this way."""

from __future__ import annotations


def segments(n: int, parts: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into ``parts`` contiguous, nearly equal ranges (some empty when n < parts)."""
    base, extra = divmod(int(n), int(parts))
    out, lo = [], 0
    for k in range(parts):
        hi = lo + base + (1 if k < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out
