"""The windowed policies' slots in the fused bucket, and the readout every rank takes from it.

```
[ w_i*W_i (n_params) | w_i | steps[N] | samples[N] | compute_ms[N] | sync_ms[N] | divergence[N] ... ]
```

In `bucket_layout.BucketLayout` terms: the weighted parameters are the payload, the weight a
summed field (`SUMMED_FIELDS`), and the report values per-rank fields. A windowed policy
declares these slots (`Policy.bucket_fields`, `Policy.bucket_rank_fields`) and the worker lays
out its one bucket with them at start-up, so the sync reuses the bucket the local steps write
their gradients into (`SyncLayout.inside`); a layout of its own (`SyncLayout(n, world)`) is
for arrays the caller owns.

Each rank writes its own report values at index `rank` of every per-rank field and zeros
elsewhere, so the Allreduce(SUM) that averages the parameters also gathers every rank's
report: `x + 0` is exact, so all ranks read bit-identical vectors and take identical
decisions (ElChe counts, K, divergence guard, epoch end) with no extra collective. Having the
whole vector also gives the max over ranks, which a SUM alone could not.

Values that only exist after a sync (its duration, the divergence it revealed) travel in the
next sync's bucket; decisions that use them are one sync late, and identical everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from hpc_rlx.comm.bucket_layout import BucketLayout
from hpc_rlx.base import backend

from .consensus import consensus_into, divergence_from, weigh_into

SUMMED_FIELDS: tuple[str, ...] = ("weight",)
"""The summed field of a sync: the rank's consensus weight (the SUM gives the total)."""

REPORT_FIELDS: tuple[str, ...] = ("steps", "samples", "compute_ms", "sync_ms", "divergence")
"""Per-rank report slots, each `world_size` long.

- steps: local optimizer steps this rank ran in the window just ended.
- samples: training samples it consumed in that window (epoch accounting).
- compute_ms: wall time of those steps, slowdown included, waiting excluded.
- sync_ms: wall time this rank spent in the PREVIOUS sync's Allreduce (0 on the first).
- divergence: this rank's `SyncLayout.divergence` at the PREVIOUS sync (0 on the first).
"""


def _copy_into(dst, src: np.ndarray) -> None:
    if isinstance(dst, np.ndarray):
        dst[...] = src
    else:
        dst.set(src.astype(dst.dtype, copy=False))


@dataclass(frozen=True)
class SyncReport:
    """What every rank knows after a sync: the summed weight and each rank's report."""

    total_weight: float
    values: Mapping[str, np.ndarray] = field(repr=False)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.values[name]

    @property
    def world_size(self) -> int:
        return len(next(iter(self.values.values())))

    @property
    def applied(self) -> bool:
        """Whether the consensus replaced the params (False when every rank was idle)."""
        return self.total_weight > 0

    @property
    def steps(self) -> list[int]:
        return [int(round(s)) for s in self.values["steps"]]

    @property
    def total_samples(self) -> int:
        return int(round(float(np.sum(self.values["samples"], dtype=np.float64))))

    def counted(self) -> tuple[float, float, float]:
        """(samples, loss sum, correct) the epoch's means count from this sync: a rank's window
        that went non-finite is left out, its samples with its loss."""
        bad = self.values["nonfinite"] > 0
        samples = self.total_samples - float(np.sum(np.asarray(self.values["samples"])[bad]))
        return samples, float(np.sum(self.values["loss_sum"])), float(np.sum(self.values["correct"]))

    @property
    def ms_per_step(self) -> list[float]:
        """Each rank's ms per local step; NaN for a rank that ran no step this window."""
        out = []
        for ms, n in zip(self.values["compute_ms"], self.values["steps"]):
            out.append(float(ms) / float(n) if n > 0 else math.nan)
        return out

    @property
    def slowest_ms_per_step(self) -> float | None:
        """The largest ms/step among ranks that ran steps (the async controller's input)."""
        known = [m for m in self.ms_per_step if not math.isnan(m)]
        return max(known) if known else None

    @property
    def window_ms(self) -> float:
        """The window's wall time: the slowest rank's compute time (the others wait)."""
        return float(np.max(self.values["compute_ms"]))

    @property
    def comm_ms(self) -> float | None:
        """Cost of the previous Allreduce: the smallest time any rank spent in it.

        Every other rank's time also contains waiting for stragglers; the last rank to
        arrive waits for nobody. None before any sync has been timed.
        """
        times = [float(t) for t in self.values["sync_ms"] if t > 0]
        return min(times) if times else None

    @property
    def max_divergence(self) -> float | None:
        """Max over ranks of the previous sync's relative divergence (None if not carried).

        Zero on the first sync and for idle ranks; a NaN (a rank whose params blew up) reads
        as infinite, so the guard trips instead of treating it as calm.
        """
        d = self.values.get("divergence")
        if d is None:
            return None
        if np.any(np.isnan(d)):
            return math.inf
        return float(np.max(d))


class SyncLayout:
    """The sync's slots in a `BucketLayout` (`bucket`), plus pack / finish / read.

    `pack` and `finish` do not allocate on the parameter path; the tail is staged in a small
    host array owned by the layout.
    """

    def __init__(self, n_params: int, world_size: int,
                 fields: Sequence[str] = REPORT_FIELDS, layout: BucketLayout | None = None):
        if len(set(fields)) != len(fields):
            raise ValueError(f"duplicate report fields: {list(fields)}")
        if layout is None:
            layout = BucketLayout(n_params, SUMMED_FIELDS, fields, world_size)
        missing = ([f for f in SUMMED_FIELDS if f not in layout.fields]
                   + [f for f in fields if f not in layout.rank_fields])
        if missing or layout.payload_size != n_params or layout.world_size != world_size:
            raise ValueError(f"the bucket layout lacks the sync's slots {missing} or its size "
                             f"({layout.payload_size} params, {layout.world_size} ranks) is not "
                             f"{n_params} params, {world_size} ranks")
        self.bucket = layout
        self.n_params = layout.payload_size
        self.world_size = layout.world_size
        self.fields = tuple(fields)
        self.size = layout.size
        self._weight = layout.field_index("weight")
        self._tail = np.zeros(layout.tail_size, dtype=np.float64)   # staged on the host

    @classmethod
    def inside(cls, layout: BucketLayout, fields: Sequence[str] = REPORT_FIELDS) -> "SyncLayout":
        """The sync's slots in an existing bucket layout (the worker's one bucket)."""
        return cls(layout.payload_size, layout.world_size, fields, layout)

    def field_slice(self, name: str) -> slice:
        return self.bucket.rank_span(name)

    def pack(self, bucket, params, weight: float, rank: int,
             report: Mapping[str, float], reference=None) -> None:
        """Fill the whole bucket for this rank: weighted params (with `reference`, the weighted
        difference from it), weight, own report slots (every other tail slot zero)."""
        if bucket.shape[0] != self.size:
            raise ValueError(f"bucket has {bucket.shape[0]} slots, layout needs {self.size}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        weigh_into(params, weight, self.bucket.payload_of(bucket), reference)
        self.pack_tail(bucket, weight, rank, report)

    def pack_tail(self, bucket, weight: float, rank: int, report: Mapping[str, float]) -> None:
        """Only the tail of `pack`: the weight and this rank's report slots (a streaming sync
        stages the payload's fragment itself)."""
        unknown = set(report) - set(self.fields)
        if unknown:
            raise ValueError(f"unknown report fields {sorted(unknown)}; known: {list(self.fields)}")
        self._tail.fill(0.0)
        self._tail[self._weight] = weight
        for name in self.fields:
            self.bucket.write(self._tail, name, float(report.get(name, 0.0)), rank)
        _copy_into(self.bucket.tail_of(bucket), self._tail)

    def total_weight(self, bucket) -> float:
        """The summed weight of a reduced bucket."""
        return float(self.bucket.tail_of(bucket)[self._weight])

    def finish(self, bucket, out_params, reference=None) -> bool:
        """Apply the consensus to `out_params` (`consensus.consensus_into`; `reference` as in
        `pack`); False when every rank was idle (`out_params` unchanged)."""
        return consensus_into(self.bucket.payload_of(bucket), self.total_weight(bucket), out_params,
                              reference)

    def divergence(self, params, bucket, own_weight: float | None = None, reference=None) -> float:
        """This rank's `consensus.divergence_from` the consensus in the reduced bucket."""
        return divergence_from(params, self.bucket.payload_of(bucket), self.total_weight(bucket),
                               own_weight, reference=reference)

    def read(self, bucket) -> SyncReport:
        """The reduced bucket's summed weight and every rank's report (host float64)."""
        # a device tail: one copy of a few dozen numbers
        tail = backend.to_numpy(self.bucket.tail_of(bucket)).astype(np.float64)
        values = {name: tail[self.bucket.rank_slice(name)].copy() for name in self.fields}
        return SyncReport(total_weight=float(tail[self._weight]), values=values)
