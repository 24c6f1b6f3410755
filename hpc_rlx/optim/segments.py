"""Where each parameter lies in an optimizer's flat array: its segments.

An optimizer steps one flat array: the model's trainable parameters packed in order
(`graph.ParamLayout`), or, under `comm.shard=optimizer`, this rank's contiguous slice of them
(`comm.shard.ParamShard`). A slice boundary may cut a parameter, so a rank may hold only part
of one: its segment is then not ``whole``, and a per-parameter quantity (a trust ratio's norms)
must add the parts the other ranks hold. That sum is the MPI layer's (`comm.shard.SplitNorms`,
passed to the optimizer as its ``combine_norms``); everything here is pure.

Per-parameter settings (a parameter excluded from weight decay, a learning-rate multiplier)
select segments by ``name``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """One parameter's part of the optimizer's flat array."""
    name: str       # the parameter's name ("" for an array stepped as one anonymous parameter)
    index: int      # its place among the model's trainable parameters
    start: int      # its part: [start, stop) of the optimizer's flat array
    stop: int
    whole: bool     # the array holds all of it (False: another rank's slice holds the rest)

    @property
    def size(self) -> int:
        return self.stop - self.start


def whole_array(size: int) -> tuple[Segment, ...]:
    """An array without declared parameters: one parameter of ``size`` values (none if 0)."""
    return (Segment("", 0, 0, int(size), True),) if size else ()


def slice_segments(spans, lo: int, hi: int) -> tuple[Segment, ...]:
    """The segments of the slice [lo, hi) of the trainable parameters, in slice coordinates.
    ``spans``: (name, offset, size) of every trainable parameter, in flat order."""
    out = []
    for index, (name, offset, size) in enumerate(spans):
        a, b = max(lo, int(offset)), min(hi, int(offset) + int(size))
        if a < b:
            out.append(Segment(str(name), index, a - lo, b - lo, a == offset and b == offset + size))
    return tuple(out)


def cut_parameters(spans, starts) -> list[int]:
    """Indices of the parameters that a slice boundary cuts: some slice starts strictly inside
    them (``starts``: where each slice begins, in the flat trainable array)."""
    return [index for index, (_, offset, size) in enumerate(spans)
            if any(offset < s < offset + size for s in starts)]


def check_segments(segments, size: int) -> tuple[Segment, ...]:
    """``segments`` as a tuple, refused unless they tile [0, size) in order."""
    segments = tuple(segments)
    at = 0
    for s in segments:
        if s.start != at or s.stop <= s.start:
            raise ValueError(f"parameter segments must tile the optimizer's {size} values in order; "
                             f"{s.name!r} covers [{s.start}, {s.stop}) where {at} was next")
        at = s.stop
    if at != size:
        raise ValueError(f"parameter segments cover {at} of the optimizer's {size} values")
    return segments
