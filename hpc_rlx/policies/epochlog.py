"""Per-epoch record of what a windowed policy did, for metrics.jsonl (pure, no MPI).

Everything is fed from `SyncReport`s, which are bit-identical on every rank, so rank 0's
record describes the whole cluster. Keys:

- syncs: synchronisations (fused Allreduces) in the epoch.
- local_steps: per rank, local optimizer steps in the epoch.
- steps_per_sync: per rank, mean local steps per sync.
- window_steps: per rank, the steps planned for the next full window (the settled split).
- K: cadence: the anchor (steps of the slowest rank per sync); async: the interval.
- k_trace: the K each window of the epoch ran with (async: stretched so that the epoch
  splits into equal windows, `window.stretch_to_epoch`).
- fragment_trace: with streaming syncs (`policy.fragments`), the fragment each sync of the
  epoch carried, in the order they were applied (`policy.fragment_schedule`); absent otherwise.
- divergence: the largest max-over-ranks `||W_i - W|| / ||W||` reported in the epoch.
- comm_share: summed sync cost / summed window compute wall. The sync cost is the smallest
  time any rank spent in a sync (the last rank to arrive waits for nobody), the window wall
  the slowest rank's compute time. It is what `overhead_target` is compared with. Sync
  costs travel in the next sync's bucket, so the epoch's first sync carries the previous
  epoch's last cost.
- idle_syncs: syncs where every weight was zero (the model was kept as it was).
- nonfinite_windows: rank-windows dropped because they went non-finite (on_nonfinite=skip).
"""

from __future__ import annotations

import math
from typing import Sequence

from .sync_slots import SyncReport


class EpochLog:
    def __init__(self, world_size: int):
        self.world_size = int(world_size)
        self.syncs = 0
        self.local_steps = [0] * self.world_size
        self.k_trace: list[int] = []
        self.fragment_trace: list[int] = []
        self.divergence: float | None = None
        self.comm_ms = 0.0
        self.window_ms = 0.0
        self.idle_syncs = 0
        self.nonfinite_windows = 0

    def add(self, report: SyncReport, k: int, nonfinite_ranks: int = 0, fragment: int | None = None) -> None:
        """One sync: its reduced report, the K its window ran with and the fragment it carried
        (None: the whole model)."""
        self.syncs += 1
        if fragment is not None:
            self.fragment_trace.append(int(fragment))
        for r, s in enumerate(report.steps):
            self.local_steps[r] += s
        self.k_trace.append(int(k))
        d = report.max_divergence
        if d is not None and (self.divergence is None or d > self.divergence or math.isnan(d)):
            self.divergence = d
        comm = report.comm_ms
        if comm is not None and report.window_ms > 0:
            self.comm_ms += comm
            self.window_ms += report.window_ms
        if not report.applied:
            self.idle_syncs += 1
        self.nonfinite_windows += int(nonfinite_ranks)

    def state_dict(self) -> dict:
        """JSON-able, for a checkpoint taken in the middle of an epoch."""
        return dict(self.__dict__)

    @classmethod
    def from_state(cls, state: dict, world_size: int) -> "EpochLog":
        """The log of a checkpoint; per-rank counts restart on another world size."""
        log = cls(world_size)
        for key, value in state.items():
            if hasattr(log, key) and key not in ("world_size", "local_steps"):
                setattr(log, key, value)
        if int(state.get("world_size", world_size)) == world_size:
            log.local_steps = [int(s) for s in state["local_steps"]]
        return log

    @property
    def comm_share(self) -> float | None:
        return self.comm_ms / self.window_ms if self.window_ms > 0 else None

    def record(self, k: int, window_steps: Sequence[int], **extra) -> dict:
        per_sync = [round(s / self.syncs, 3) if self.syncs else 0.0 for s in self.local_steps]
        rec = {
            "syncs": self.syncs,
            "local_steps": list(self.local_steps),
            "steps_per_sync": per_sync,
            "window_steps": [int(c) for c in window_steps],
            "K": int(k),
            "k_trace": list(self.k_trace),
            "divergence": _finite_or_str(self.divergence),
            "comm_share": None if self.comm_share is None else round(self.comm_share, 5),
            "sync_cost_s": round(self.comm_ms / 1e3, 6),
            "window_s": round(self.window_ms / 1e3, 6),
            "idle_syncs": self.idle_syncs,
            "nonfinite_windows": self.nonfinite_windows,
        }
        if self.fragment_trace:
            rec["fragment_trace"] = list(self.fragment_trace)
        rec.update(extra)
        return rec


def _finite_or_str(x: float | None):
    # JSON has no inf/nan; keep the information as a string instead of writing invalid JSON
    if x is None or math.isfinite(x):
        return x
    return "inf" if x > 0 else "nan"
