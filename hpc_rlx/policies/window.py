"""Epoch accounting for windowed policies: trim a window to what is left of the epoch, and the
state of a policy's windows (`WindowState`) and of one rank's local steps (`LocalWork`).

An epoch covers each sample once in total across the cluster, whatever the ranks' speeds.
Every rank knows the samples consumed so far (summed from the bucket's `samples` slots) and
the planned counts, so each computes the same trimmed plan and the same "epoch over"
decision: no rank waits on a collective the others will not issue. A rank trimmed to 0 steps
still joins the sync with weight 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import Sequence

from .epochlog import EpochLog
from .smoothing import RecentMin


def plan_window(counts: Sequence[int], samples_per_step: Sequence[int],
                remaining: int) -> list[int]:
    """Counts, kept close to proportional to `counts`, whose samples fit in `remaining`.

    `samples_per_step[r]` is rank r's local batch. When the planned window fits it is returned
    unchanged. Otherwise every count is scaled by `remaining / planned` and floored; then,
    while some rank below its planned count still has a batch that fits, the one furthest
    behind its share (smallest `(n + 1) / count`, ties to the lower rank) gets one more step.
    Exact integer / rational arithmetic, so every rank gets the same answer. All zeros means
    the epoch is over; a leftover smaller than every batch that could still run is for the
    caller to run as a short batch or drop.
    """
    if len(counts) != len(samples_per_step):
        raise ValueError(f"{len(counts)} counts but {len(samples_per_step)} batch sizes")
    if any(c < 0 for c in counts) or any(b <= 0 for b in samples_per_step):
        raise ValueError(f"counts must be >= 0 and batches > 0: {list(counts)}, "
                         f"{list(samples_per_step)}")
    counts = [int(c) for c in counts]
    remaining = max(0, int(remaining))
    planned = sum(c * b for c, b in zip(counts, samples_per_step))
    if planned <= remaining:
        return counts
    got = [c * remaining // planned for c in counts]
    left = remaining - sum(n * b for n, b in zip(got, samples_per_step))
    while True:
        fits = [r for r, (n, c, b) in enumerate(zip(got, counts, samples_per_step))
                if n < c and b <= left]
        if not fits:
            return got
        r = min(fits, key=lambda r: (Fraction(got[r] + 1, counts[r]), r))
        got[r] += 1
        left -= samples_per_step[r]


def stretch_to_epoch(k: int, remaining_steps: int, cap: int) -> int:
    """An interval of at least `k` that splits the rest of the epoch into equal windows.

    With K local steps between syncs and R steps left in the epoch, plain K-step windows end
    the epoch with a short one whose sync costs as much as a full window's: at 4-5 windows
    per epoch that alone pushes the communication share 20% over the target. Taking the
    fewest windows of at least K steps that cover R (`floor(R / K)` of them, the last one
    absorbing the rest) avoids the short window; `cap` (the max anchor, or the divergence
    guard's ceiling) bounds the stretch.
    """
    if k < 1 or cap < 1:
        raise ValueError(f"k and cap must be >= 1, got k={k}, cap={cap}")
    k = min(k, cap)
    if remaining_steps <= k:
        return k
    windows = remaining_steps // k
    return max(k, min(cap, -(-remaining_steps // windows)))


@dataclass
class LocalWork:
    """What one rank's local steps of a window did."""
    steps: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    correct: float = 0.0
    compute: float = 0.0        # seconds, the slowdown's sleep included
    measured: float = 0.0       # compute, the process's cold first step extrapolated away
    data_s: float = 0.0         # gathering batches
    bad: bool = False           # a non-finite loss: the window is dropped


_KEPT_BY_RESTART = ("lr", "epoch_log", "epoch_over", "batches", "epoch_samples")


@dataclass
class WindowState:
    """Where a windowed policy's windows stand: the positions and the epoch's samples (the same
    on every rank, moved from what the syncs report), the LR of the last window, this rank's
    timings for the next report, and the epoch's record. A process that starts again on another
    world size (`restart`) keeps only the LR and the record of the epoch."""

    world: int
    batches: list[int] = field(default_factory=list)     # per rank: samples per local step
    epoch_samples: int = 0              # the samples of one epoch (policy=sync's)
    cursors: list[int] | None = None    # per rank: local steps taken since the start
    epoch_consumed: int = 0             # samples consumed so far in this epoch
    lr: float | None = None             # the inner LR of the last window
    sync_ms: float = 0.0                # this rank's time in the last sync (the next report's)
    divergence: float = 0.0             # ... its divergence from that sync's consensus
    cold: bool = True                   # the next local step is this process's first
    synced: bool = False                # this process has synced once (its setup cost paid)
    costs: RecentMin = field(default_factory=lambda: RecentMin(3))    # sync costs, cadence's filter
    log: EpochLog | None = None         # this epoch's record so far
    epoch_log: EpochLog | None = None   # the record of the epoch, kept past its end
    epoch_over: bool = False            # a recovery during validation: the epoch has no window left
    adopt_position: bool = False        # a policy=sync checkpoint: its position, taken at setup

    def restart(self, world: int) -> None:
        """No position and no measurements on `world` ranks (a checkpoint's go over them)."""
        fresh = WindowState(int(world))
        for f in fields(self):
            if f.name not in _KEPT_BY_RESTART:
                setattr(self, f.name, getattr(fresh, f.name))

    def lr_step(self, worker) -> int:
        """Data progress in global batches: the LR clock of policy=sync, whose schedule spans
        the configured epochs (max_steps, which counts syncs here, only stops early)."""
        within = self.epoch_consumed * worker.steps_per_epoch // max(1, self.epoch_samples)
        return worker.epoch * worker.steps_per_epoch + int(within)

    def begin(self, worker) -> float:
        """A window starts: its inner LR (it follows data progress, see `lr_step`)."""
        self.lr = worker.lr_at(self.lr_step(worker))
        return self.lr

    def fraction(self) -> float:
        """How much of the epoch is trained: samples consumed over the epoch's."""
        return self.epoch_consumed / max(1, self.epoch_samples)

    def samples_left(self) -> int:
        return self.epoch_samples - self.epoch_consumed

    def trim(self, planned: list[int]) -> list[int]:
        """The planned counts trimmed to what is left of the epoch (all zero: it is over)."""
        return plan_window(planned, self.batches, self.samples_left())

    def advance(self, steps: Sequence[int], samples: int) -> None:
        """Every rank's local steps and the samples they consumed, as a sync reports them."""
        for r, s in enumerate(steps):
            self.cursors[r] += s
        self.epoch_consumed += samples

    def advance_planned(self, counts: Sequence[int]) -> None:
        """A sub-window sent: the planned counts every rank knows move the positions."""
        for r, c in enumerate(counts):
            self.cursors[r] += c
            self.epoch_consumed += c * self.batches[r]

    def timed_sync(self, seconds: float) -> None:
        """A whole sync's time, for the next report: this process's first pays one-off setup
        (buffers, connections), not a cost the controllers should plan with, so it reads 0."""
        self.sync_ms = seconds * 1e3 if self.synced else 0.0
        self.synced = True

    def waited(self, seconds: float) -> None:
        """A fragment's wait for its sum, for the next report (every wait counts)."""
        self.sync_ms = seconds * 1e3

    def end_epoch(self) -> None:
        """The epoch's samples are consumed: the next epoch starts from none."""
        self.epoch_consumed = 0
        self.log = None
