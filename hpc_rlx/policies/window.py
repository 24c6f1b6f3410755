"""Epoch accounting for windowed policies: trim a window to what is left of the epoch.

An epoch covers each sample once in total across the cluster, whatever the ranks' speeds.
Every rank knows the samples consumed so far (summed from the bucket's `samples` slots) and
the planned counts, so each computes the same trimmed plan and the same "epoch over"
decision: no rank waits on a collective the others will not issue. A rank trimmed to 0 steps
still joins the sync with weight 0.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Sequence


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
