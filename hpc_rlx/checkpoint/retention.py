"""Which checkpoints to keep: the last N, plus the best one by a validation metric.

Pure bookkeeping over step numbers and metric values; no file access. `manager.py` lists the
files, asks `plan_deletions` what to remove, and stores the history so a resumed run can rebuild
the best (an old best outside the keep-last window must survive a resume).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from hpc_rlx.base.errors import ConfigError

MODES = ("min", "max")


def metric_mode(metric: str, mode: str | None = None) -> str:
    """'min' or 'max' for `metric`: explicit `mode` wins, else *loss and *mae are min, *accuracy and *iou max."""
    if mode is not None:
        if mode not in MODES:
            raise ConfigError(f"checkpoint mode must be one of {MODES}, got {mode!r}")
        return mode
    if not isinstance(metric, str) or not metric:
        raise ConfigError(f"checkpoint.metric must be a non-empty name, got {metric!r}")
    name = metric.lower()
    if name.endswith("loss") or name.endswith("mae"):
        return "min"
    if name.endswith("accuracy") or name.endswith("acc") or name.endswith("iou"):
        return "max"
    raise ConfigError(
        f"checkpoint.metric={metric!r}: cannot tell whether lower or higher is better "
        f"(names ending in 'loss' are minimised, 'accuracy' maximised); pass mode='min' or 'max'")


def usable_value(value) -> float | None:
    """The metric as a float, or None when it cannot rank checkpoints (missing or NaN)."""
    if value is None:
        return None
    v = float(value)
    return None if math.isnan(v) else v


class BestTracker:
    """The best (step, value) seen so far; a later checkpoint replaces it only if strictly better."""

    def __init__(self, mode: str):
        if mode not in MODES:
            raise ConfigError(f"checkpoint mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.step: int | None = None
        self.value: float | None = None

    def is_better(self, candidate: float, current: float) -> bool:
        return candidate < current if self.mode == "min" else candidate > current

    def offer(self, step: int, value) -> bool:
        """Consider checkpoint `step` with metric `value`; True if it became the best."""
        v = usable_value(value)
        if v is None:
            return False
        if self.value is None or self.is_better(v, self.value):
            self.step, self.value = step, v
            return True
        return False

    def rebuild(self, history: Iterable[tuple[int, float | None]]) -> None:
        """Recompute the best from (step, value) pairs, in the order they were recorded."""
        self.step, self.value = None, None
        for step, value in history:
            self.offer(step, value)


def record(history: list[tuple[int, float | None]], step: int, value) -> list[tuple[int, float | None]]:
    """History of the timeline that now ends at `step`, in step order.

    Entries at or after `step` belong to an earlier pass over those steps (a re-save, or a run
    resumed from an older checkpoint) and are replaced.
    """
    kept = sorted(((s, v) for s, v in history if s < step), key=lambda e: e[0])
    kept.append((step, usable_value(value)))
    return kept


def plan_deletions(existing: Iterable[int], current: int, keep_last: int,
                   best: int | None) -> list[int]:
    """Steps whose checkpoint files should go once checkpoint `current` is safely written.

    Keeps the `keep_last` highest steps up to and including `current`, plus `best`. Steps above
    `current` are never touched: they belong to a timeline abandoned by resuming an older
    checkpoint and are overwritten only when training reaches them again.
    """
    if keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last must be >= 1, got {keep_last!r}")
    timeline = sorted({s for s in existing if s <= current} | {current})
    keep = set(timeline[-keep_last:])
    if best is not None:
        keep.add(best)
    return [s for s in timeline if s not in keep]
