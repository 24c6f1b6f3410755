"""ElChe: how many local steps each rank runs before the next cadence sync.

Rules (the published scheduler, with the changes noted):

- Each rank's ms/step is smoothed with `adaptive_ema`.
- `counts_r = max(1, round(anchor * slow / ms_r))` with `slow` the slowest rank's ms/step, so
  the slowest rank runs `anchor` steps and everyone reaches the sync at about the same time.
- Hysteresis: a rank's speed ratio `slow / ms_r` is only replaced when the new ratio differs
  from the one in use by more than 10%. Applying the 10% rule to the ratio instead of to the
  count keeps timing jitter out of the counts while still letting anchor changes through at
  once (a count-level 10% rule would freeze the anchor's one-step shrink for anchor >= 10).
- `max_batch_diff = d` (optional): each update moves a count by at most `d` (for d > 0), and
  no rank leads the slowest by more than `d` steps; `d = 0` is lockstep.
- The anchor grows to `ceil(anchor * over / target)` (capped at `max_anchor`) when the sync
  overhead `over = comm_ms / window_ms` exceeds `overhead_target`, and shrinks by one when it
  is below half of it.

All inputs come out of the sync's own bucket (`SyncReport`), so every rank computes the same
counts. The state is a handful of numbers and JSON-serialisable for checkpoints.
"""

from __future__ import annotations

import math
from typing import Sequence

from hpc_rlx.base.checks import OPEN_UNIT, at_least

from hpc_rlx.base.errors import ConfigError
from .smoothing import adaptive_ema, round_half_up, valid_time

HYSTERESIS = 0.10


class ElcheScheduler:
    def __init__(self, world_size: int, anchor: int = 10, max_anchor: int = 200,
                 overhead_target: float = 0.10, max_batch_diff: int | None = None,
                 hysteresis: float = HYSTERESIS):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        _check_int("policy.anchor", anchor, 1)
        _check_int("policy.max_anchor", max_anchor, 1)
        if anchor > max_anchor:
            raise ConfigError(f"policy.anchor ({anchor}) must be <= policy.max_anchor ({max_anchor})")
        OPEN_UNIT("policy.overhead_target", overhead_target)
        if max_batch_diff is not None:
            _check_int("policy.max_batch_diff", max_batch_diff, 0)
        if not 0 <= hysteresis < 1:
            raise ValueError(f"hysteresis must be in [0, 1), got {hysteresis}")
        self.world_size = int(world_size)
        self.max_anchor = int(max_anchor)
        self.overhead_target = float(overhead_target)
        self.max_batch_diff = None if max_batch_diff is None else int(max_batch_diff)
        self.hysteresis = float(hysteresis)
        self.anchor = int(anchor)
        self.counts: list[int] = [self.anchor] * self.world_size
        self.ema_ms: list[float | None] = [None] * self.world_size
        self.ratios: list[float] = [1.0] * self.world_size
        self.last_overhead: float | None = None

    def observe(self, ms_per_step: Sequence[float], comm_ms: float | None = None,
                window_ms: float | None = None) -> list[int]:
        """Take one sync's measurements; return every rank's step count for the next window.

        `ms_per_step[r]` is rank r's ms per local step in the window just ended (NaN or 0 for
        a rank that ran none: its estimate is kept). `comm_ms` is the Allreduce cost and
        `window_ms` the window's wall time; the anchor is left alone when either is missing.
        """
        if len(ms_per_step) != self.world_size:
            raise ValueError(f"expected {self.world_size} ms/step values, got {len(ms_per_step)}")
        for r, ms in enumerate(ms_per_step):
            if valid_time(ms):
                self.ema_ms[r] = adaptive_ema(self.ema_ms[r], float(ms))
        self._update_anchor(comm_ms, window_ms)
        self._update_ratios()
        self.counts = self._limit(self._targets())
        return list(self.counts)

    def _update_anchor(self, comm_ms, window_ms) -> None:
        if comm_ms is None or not valid_time(window_ms) or not math.isfinite(comm_ms):
            return
        over = max(float(comm_ms), 0.0) / float(window_ms)
        self.last_overhead = over
        if over > self.overhead_target:
            grown = math.ceil(self.anchor * over / self.overhead_target)
            self.anchor = min(self.max_anchor, max(self.anchor, grown))
        elif over < self.overhead_target / 2:
            self.anchor = max(1, self.anchor - 1)

    def _update_ratios(self) -> None:
        known = [m for m in self.ema_ms if m is not None]
        if not known:
            return
        slow = max(known)
        for r, m in enumerate(self.ema_ms):
            if m is None:
                continue
            new = slow / m
            old = self.ratios[r]
            if abs(new - old) > self.hysteresis * old:
                self.ratios[r] = new

    def _targets(self) -> list[int]:
        return [max(1, round_half_up(self.anchor * q)) for q in self.ratios]

    def _limit(self, targets: list[int]) -> list[int]:
        d = self.max_batch_diff
        if d is None:
            return targets
        if d > 0:
            targets = [min(max(t, c - d), c + d) for t, c in zip(targets, self.counts)]
        floor = min(targets)
        return [min(t, floor + d) for t in targets]

    def metrics(self) -> dict:
        """What to log for this sync (metrics.jsonl)."""
        return {"anchor": self.anchor, "counts": list(self.counts),
                "overhead": self.last_overhead,
                "ms_per_step_ema": [None if m is None else round(m, 4) for m in self.ema_ms]}

    def state_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "anchor": self.anchor,
            "max_anchor": self.max_anchor,
            "overhead_target": self.overhead_target,
            "max_batch_diff": self.max_batch_diff,
            "hysteresis": self.hysteresis,
            "counts": list(self.counts),
            "ema_ms": list(self.ema_ms),
            "ratios": list(self.ratios),
            "last_overhead": self.last_overhead,
        }

    def load_state_dict(self, state: dict) -> None:
        if int(state["world_size"]) != self.world_size:
            # a resumed run on another world size restarts the measurements, keeps the anchor
            self.anchor = min(int(state["anchor"]), self.max_anchor)
            self.counts = [self.anchor] * self.world_size
            self.ema_ms = [None] * self.world_size
            self.ratios = [1.0] * self.world_size
            self.last_overhead = None
            return
        self.anchor = min(int(state["anchor"]), self.max_anchor)
        self.counts = [int(c) for c in state["counts"]]
        self.ema_ms = [None if m is None else float(m) for m in state["ema_ms"]]
        self.ratios = [float(q) for q in state["ratios"]]
        lo = state.get("last_overhead")
        self.last_overhead = None if lo is None else float(lo)


def _check_int(name: str, value, minimum: int) -> None:
    at_least(minimum)(name, value)
