"""Where everything sits in a fused bucket: the one layout for every policy.

```
[ payload (payload_size) | summed fields (one slot each) | per-rank fields (world_size slots each) ]
```

With ``tail_first=True`` (``comm.overlap``: backward finishes the payload from its end, so the
chunk that starts last, ``[0, c)``, must carry the tail) the tail comes first:
``[ summed fields | per-rank fields | payload ]``. The layout is internal to one run's
collectives; checkpoints store parameters by `graph.params.ParamLayout`, never by this.

- The payload is the big part: the summed gradients (`policy=sync`), or the work-weighted
  parameters (the windowed policies, `policies.sync_slots.SyncLayout`), in the same bucket: the
  worker lays it out once with the fields its policy declares (`Policy.bucket_fields`,
  `Policy.bucket_rank_fields`).
- A summed field is one number every rank adds to: sample count, loss sum, a weight.
- A per-rank field has one slot per rank; each rank writes its own slot and zeros elsewhere, so
  the SUM gathers every rank's value (``x + 0`` is exact) and every rank reads the same vector.

The control flags (`CONTROL_FLAGS`) are either kind: a flag is raised when any slot is > 0.
Pure offsets and NumPy (no MPI); `comm.FusedBucket` allocates a bucket from a layout.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

CONTROL_FLAGS: tuple[str, ...] = ("stop", "nonfinite", "ckpt_due")
"""Agreed through the bucket every sync: a stop was asked for (signal), a rank saw NaN/Inf,
rank 0's checkpoint clock is due."""

STEP_FIELDS: tuple[str, ...] = ("samples", "loss_sum", "correct") + CONTROL_FLAGS
"""The summed fields of `policy=sync`'s bucket, after the gradients."""


class BucketLayout:
    """Offsets of one fused bucket (see the module docstring). Tail offsets count from the
    tail's start; absolute ones (`*_offset`, `rank_span`) from the bucket's start."""

    def __init__(self, payload_size: int, fields: Sequence[str] = (),
                 rank_fields: Sequence[str] = (), world_size: int = 1, tail_first: bool = False):
        names = tuple(fields) + tuple(rank_fields)
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate bucket fields: {list(names)}")
        if payload_size < 0 or world_size < 1:
            raise ValueError(f"bad layout: payload_size={payload_size}, world_size={world_size}")
        self.payload_size = int(payload_size)
        self.fields = tuple(fields)
        self.rank_fields = tuple(rank_fields)
        self.world_size = int(world_size)
        self._field_index = {name: i for i, name in enumerate(self.fields)}
        first = len(self.fields)
        self._rank_start = {name: first + i * self.world_size for i, name in enumerate(self.rank_fields)}
        self.rank_fields_start = first          # tail offset of the first per-rank slot
        self.tail_size = first + len(self.rank_fields) * self.world_size
        self.size = self.payload_size + self.tail_size
        self.tail_first = bool(tail_first)
        self.tail_start = 0 if self.tail_first else self.payload_size       # absolute offsets
        self.payload_start = self.tail_size if self.tail_first else 0

    def for_world(self, world_size: int) -> "BucketLayout":
        """The same fields, with per-rank slots for `world_size` ranks."""
        return BucketLayout(self.payload_size, self.fields, self.rank_fields, world_size, self.tail_first)

    def within(self, buffer, larger: "BucketLayout"):
        """This layout's bucket inside `buffer`, a bucket laid out by `larger` (the same payload,
        a tail at least as long): the same payload memory, so views of it stay valid."""
        if larger.payload_size != self.payload_size or larger.tail_size < self.tail_size:
            raise ValueError(f"a bucket of tail {self.tail_size} does not fit in one of tail {larger.tail_size}")
        start = larger.tail_size - self.tail_size if self.tail_first else 0
        return buffer[start: start + self.size]

    def payload_of(self, buffer):
        """The payload view of a whole bucket array laid out by this layout."""
        return buffer[self.payload_start: self.payload_start + self.payload_size]

    def tail_of(self, buffer):
        """The tail view of a whole bucket array laid out by this layout."""
        return buffer[self.tail_start: self.tail_start + self.tail_size]

    # ---- offsets in the tail --------------------------------------------------------------
    def field_index(self, name: str) -> int:
        return self._field_index[name]

    def rank_slice(self, name: str) -> slice:
        start = self._rank_start[name]
        return slice(start, start + self.world_size)

    # ---- offsets in the whole bucket ------------------------------------------------------
    def field_offset(self, name: str) -> int:
        return self.tail_start + self._field_index[name]

    def rank_span(self, name: str) -> slice:
        start = self.tail_start + self._rank_start[name]
        return slice(start, start + self.world_size)

    # ---- reading and writing a tail (host array) ------------------------------------------
    def write(self, tail, name: str, value: float, rank: int = 0) -> None:
        """Set a summed field, or this rank's slot of a per-rank field."""
        if name in self._field_index:
            tail[self._field_index[name]] = value
        elif 0 <= rank < self.world_size:
            tail[self._rank_start[name] + rank] = value
        else:       # it would land in the next field's slots
            raise ValueError(f"rank {rank} has no slot of {name!r} (slots for {self.world_size} ranks)")

    def read(self, tail, name: str):
        """A summed field as a float, a per-rank field as its `world_size` slots (a view)."""
        if name in self._field_index:
            return float(tail[self._field_index[name]])
        return tail[self.rank_slice(name)]

    def flags(self, tail) -> dict[str, bool]:
        """The reduced control flags: raised when any rank raised them."""
        return {name: raised(self.read(tail, name)) for name in CONTROL_FLAGS}


def raised(value) -> bool:
    """A control flag's reduced slot(s) as a yes/no: any value above zero."""
    if isinstance(value, float):
        return value > 0
    return bool(np.any(np.asarray(value) > 0))


def flag_values(stop: bool, nonfinite: bool, ckpt_due: bool) -> Mapping[str, float]:
    """This rank's control flags as bucket values (1.0 raised, 0.0 not), in `CONTROL_FLAGS` order."""
    return {"stop": 1.0 if stop else 0.0, "nonfinite": 1.0 if nonfinite else 0.0,
            "ckpt_due": 1.0 if ckpt_due else 0.0}
