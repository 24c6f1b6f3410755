"""When a run writes a checkpoint: its save triggers, pure decisions on steps, epochs and a
clock (no MPI, no files).

The default (``checkpoint=default``) is a time interval plus the end of the run and preemption:
a short run writes its final checkpoint (and at most one more for the best epoch, see
`BestWatch`), a long one also saves at least every ``every_minutes`` of training, so a
checkpoint never costs most of a short run and a crash never costs more than those minutes.
Step and epoch intervals are there for whoever asks for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hpc_rlx.checkpoint.retention import BestTracker, metric_mode

# The reason logged for a save that a step or minutes interval asked for
# ("checkpoint (cadence) at step N: ..."): readers of the log match this word, so it stays as
# it was although the code calls these save triggers.
INTERVAL_REASON = "cadence"


class SaveTriggers:
    """The step, epoch and minutes intervals of `checkpoint.every_*`; None or 0 turns one off.

    clock: seconds, monotonic (tests pass their own). The minutes interval is measured from the
    start of training or the last save, whichever is later.
    """

    def __init__(self, every_steps=None, every_epochs=None, every_minutes=None,
                 clock: Callable[[], float] = time.monotonic):
        self.every_steps = int(every_steps) if every_steps else None
        self.every_epochs = int(every_epochs) if every_epochs else None
        self.every_minutes = float(every_minutes) if every_minutes else None
        self.clock = clock
        self._last = clock()

    @classmethod
    def from_config(cls, cfg: dict, clock: Callable[[], float] = time.monotonic) -> "SaveTriggers":
        return cls(cfg["every_steps"], cfg["every_epochs"], cfg["every_minutes"], clock)

    @property
    def enabled(self) -> bool:
        return bool(self.every_steps or self.every_epochs or self.every_minutes)

    def steps_due(self, step: int) -> bool:
        return self.every_steps is not None and step % self.every_steps == 0

    def epoch_due(self, epoch: int) -> bool:
        return self.every_epochs is not None and epoch % self.every_epochs == 0

    def minutes_due(self) -> bool:
        return self.every_minutes is not None and self.clock() - self._last >= 60.0 * self.every_minutes

    def restart(self) -> None:
        """Training starts (after startup and resume) or a checkpoint was just written."""
        self._last = self.clock()

    def describe(self) -> str:
        parts = [f"every {n:g} {what}" for n, what in ((self.every_steps, "steps"),
                 (self.every_epochs, "epochs"), (self.every_minutes, "min")) if n]
        return ", ".join(parts + ["at the end and on preemption"]) if parts else "off"


class BestWatch:
    """Which epoch ends are the best so far by `checkpoint.metric`, among those seen since start
    or resume. The run keeps that epoch's state in memory and writes it only with the next save,
    so the best survives without a file per epoch (see RuntimeCheckpoints)."""

    def __init__(self, metric: str):
        self.tracker = BestTracker(metric_mode(metric))

    def seed(self, step: int | None, value: float | None) -> None:
        """Continue from the best a resumed run's checkpoints already hold."""
        self.tracker.step, self.tracker.value = step, value

    def offer(self, step: int, value) -> bool:
        """True if epoch-end `step` with metric `value` is strictly better than any before."""
        return self.tracker.offer(step, value)
