"""Layout of a policy sync bucket and the readout every rank takes from it.

```
[ w_i*W_i (n_params) | w_i | steps[N] | samples[N] | compute_ms[N] | sync_ms[N] | divergence[N] ]
```

In `bucket_layout.BucketLayout` terms: the weighted parameters are the payload, the weight a
summed field, and the report values per-rank fields.

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

from .consensus import finish_consensus, pack_consensus

REPORT_FIELDS: tuple[str, ...] = ("steps", "samples", "compute_ms", "sync_ms", "divergence")
"""Per-rank report slots, each `world_size` long.

- steps: local optimizer steps this rank ran in the window just ended.
- samples: training samples it consumed in that window (epoch accounting).
- compute_ms: wall time of those steps, slowdown included, waiting excluded.
- sync_ms: wall time this rank spent in the PREVIOUS sync's Allreduce (0 on the first).
- divergence: this rank's `relative_divergence` at the PREVIOUS sync (0 on the first).
"""


def _to_host(a) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "get"):  # a device array: one copy of a few dozen numbers
        return a.get()
    return np.asarray(a)


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
    """Offsets of one policy bucket (a `BucketLayout`: `bucket`), plus pack / finish / read.

    `pack` and `finish` do not allocate on the parameter path; the per-rank tail is staged in
    a small host array owned by the layout.
    """

    def __init__(self, n_params: int, world_size: int,
                 fields: Sequence[str] = REPORT_FIELDS):
        if len(set(fields)) != len(fields):
            raise ValueError(f"duplicate report fields: {list(fields)}")
        self.bucket = BucketLayout(n_params, ("weight",), fields, world_size)
        self.n_params = self.bucket.payload_size
        self.world_size = self.bucket.world_size
        self.fields = self.bucket.rank_fields
        self.weight_index = self.bucket.field_offset("weight")
        self.tail_start = self.bucket.payload_size + self.bucket.rank_fields_start
        self.size = self.bucket.size
        self._tail = np.zeros(self.bucket.tail_size, dtype=np.float64)   # staged on the host

    def field_slice(self, name: str) -> slice:
        return self.bucket.rank_span(name)

    def pack(self, bucket, params, weight: float, rank: int,
             report: Mapping[str, float]) -> None:
        """Fill the whole bucket for this rank: weighted params, weight, own report slots."""
        if bucket.shape[0] != self.size:
            raise ValueError(f"bucket has {bucket.shape[0]} slots, layout needs {self.size}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        unknown = set(report) - set(self.fields)
        if unknown:
            raise ValueError(f"unknown report fields {sorted(unknown)}; known: {list(self.fields)}")
        pack_consensus(params, weight, bucket)
        self._tail.fill(0.0)
        for name in self.fields:
            self.bucket.write(self._tail, name, float(report.get(name, 0.0)), rank)
        _copy_into(bucket[self.tail_start:], self._tail[self.bucket.rank_fields_start:])

    def finish(self, bucket, out_params) -> bool:
        """Apply the consensus to `out_params` (see `consensus.finish_consensus`)."""
        return finish_consensus(bucket[:self.tail_start], out_params)

    def read(self, bucket) -> SyncReport:
        """The reduced bucket's summed weight and every rank's report (host float64)."""
        tail = _to_host(bucket[self.weight_index:]).astype(np.float64)
        values = {name: tail[1 + i * self.world_size: 1 + (i + 1) * self.world_size].copy()
                  for i, name in enumerate(self.fields)}
        return SyncReport(total_weight=float(tail[0]), values=values)
