"""The messages between neighbouring stages: one flat buffer each, laid out once at startup.

A forward message from stage s to s+1 holds stage s's boundary outputs, one after another,
each in its graph shape with the batch dimension set to the micro-batch's rows. The backward
message from s+1 to s holds the gradients of the same values in the same places, after a
small tail (``TAIL``): the micro-batch's loss sum and correct count (computed by the last
stage, passed down with the gradients). Every stage knows every micro-batch's rows (the replica's batch is split
the same way on each), so a message's length is known to both ends; buffers are allocated
for the largest micro-batch, and shapes are never sent.

Only floating-point values can cross a cut (their gradients travel back in the same dtype).
"""

from __future__ import annotations

from math import prod

import numpy as np

from hpc_rlx.base.errors import ConfigError
from hpc_rlx.graph.shapes import FLOAT

TAIL = ("loss_sum", "correct")


def _elems(shape, rows: int) -> int:
    return prod(rows if d is None else d for d in shape)


class BoundaryLayout:
    """Offsets of the values ``names`` (types from ``types``) in a message, after ``tail`` slots."""

    def __init__(self, names, types, max_rows: int, tail: int = 0):
        self.names = tuple(names)
        self.shapes = []
        for name in self.names:
            t = types[name]
            if t.dtype != FLOAT:
                raise ConfigError(f"pipeline: '{name}' ({t.dtype}) would cross a stage boundary; only "
                                  f"floating-point values can: move the cut (parallel.cut_points)")
            self.shapes.append(tuple(t.shape))
        self.tail = int(tail)
        self.max_rows = int(max_rows)
        self.capacity = self.size(self.max_rows)

    def size(self, rows: int) -> int:
        return self.tail + sum(_elems(s, rows) for s in self.shapes)

    def views(self, buf, rows: int) -> dict:
        """name -> a view of ``buf`` in the value's shape for ``rows`` rows."""
        out, off = {}, self.tail
        for name, shape in zip(self.names, self.shapes):
            n = _elems(shape, rows)
            out[name] = buf[off:off + n].reshape(tuple(rows if d is None else d for d in shape))
            off += n
        return out

    def pack(self, buf, rows: int, arrays: dict) -> None:
        for name, view in self.views(buf, rows).items():
            np.copyto(view, arrays[name])

    def allocate(self, slots: int, dtype) -> list:
        return [np.zeros(self.capacity, dtype=dtype) for _ in range(slots)]


def micro_sizes(rows: int, micro: int) -> list:
    """The rows of each micro-batch: ``min(micro, rows)`` of them, sizes differing by at most one."""
    m = min(micro, rows)
    if m == 0:
        return []
    base, extra = divmod(rows, m)
    return [base + (1 if i < extra else 0) for i in range(m)]
