"""The adaptive EMA used for every measured time the policies act on."""

from __future__ import annotations

import math


def adaptive_ema(old: float | None, new: float, lo: float = 0.1, hi: float = 0.8) -> float:
    """Blend `new` into `old` with `a = clamp(|new - old| / old, lo, hi)`.

    A small relative change (noise) moves the estimate by only `lo` of the gap; a large one
    (a real change of speed, e.g. a node slowing down) is followed within a couple of
    samples. The first sample (old is None) is taken as is.
    """
    if old is None or not math.isfinite(old) or old <= 0:
        return float(new)
    a = min(max(abs(new - old) / old, lo), hi)
    return float(old + a * (new - old))


def valid_time(x) -> bool:
    """A usable measured time: finite and positive (idle ranks report NaN or 0)."""
    return x is not None and math.isfinite(x) and x > 0


def round_half_up(x: float) -> int:
    """Round to nearest, halves up: unambiguous, unlike Python's round-half-to-even."""
    return int(math.floor(x + 0.5))


class RecentMin:
    """The smallest of the last `n` samples: a cost estimate that ignores one-off spikes.

    Timing noise on a shared node is one-sided (preemption only adds time), so the minimum
    over a few syncs tracks the real cost, while a real increase shows up after `n` samples.
    """

    def __init__(self, n: int = 3):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = int(n)
        self.values: list[float] = []

    def add(self, x: float | None) -> float | None:
        """Take one sample (None and non-finite values are ignored); return the estimate."""
        if x is not None and math.isfinite(x) and x >= 0:
            self.values = (self.values + [float(x)])[-self.n:]
        return self.value

    @property
    def value(self) -> float | None:
        return min(self.values) if self.values else None
