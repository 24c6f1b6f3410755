"""`debug.slowdown`: make chosen ranks honestly slower, to simulate mixed hardware.

A rank with factor f sleeps `(f - 1) * t` after a step whose compute took `t` seconds, so its
wall time per step is f times what it would be (`after_step`; or `owe` per step and `flush`
once before a sync). The loop must time the steps INCLUDING this sleep, so the schedulers see
the slowdown exactly like a slow device.

Sleeping (not spinning) leaves the core to the other ranks, as a slow GPU would. `time.sleep`
overshoots by a little each call; the overshoot is carried as credit into the next step, so
the long-run factor stays exact even for millisecond steps. The credit is capped at half
the extra time owed since the last sleep: a sleep that the OS stretched by far more (a
preempted rank) is the rank being slow anyway, and a large credit would let it run unslowed
for many steps, which the schedulers would read as a sudden speed-up.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Mapping

from hpc_rlx.base.errors import ConfigError

CREDIT_CAP = 0.5


def parse_slowdown(spec, world_size: int | None = None) -> dict[int, float]:
    """`{rank: factor}` from a config mapping like `{1: 3.0}` (keys may be digit strings).

    Factors must be finite and >= 1; ranks must be >= 0 and, when `world_size` is given,
    inside the world. Empty or None means no slowdown.
    """
    if spec is None:
        return {}
    if not isinstance(spec, Mapping) and not hasattr(spec, "items"):
        raise ConfigError(f"debug.slowdown must be a mapping {{rank: factor}}, e.g. "
                          f"{{1: 3.0}}, got {spec!r}")
    out: dict[int, float] = {}
    for key, value in spec.items():
        try:
            if isinstance(key, bool) or isinstance(key, float):
                raise ValueError
            rank = int(str(key).strip())
        except ValueError:
            raise ConfigError(f"debug.slowdown: rank must be an integer, got {key!r}") from None
        try:
            if isinstance(value, bool):
                raise ValueError
            factor = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"debug.slowdown: factor for rank {rank} must be a number, "
                              f"got {value!r}") from None
        if rank < 0 or (world_size is not None and rank >= world_size):
            raise ConfigError(f"debug.slowdown names rank {rank}, but the job has ranks "
                              f"0..{(world_size or 1) - 1}")
        if not (math.isfinite(factor) and factor >= 1.0):
            raise ConfigError(f"debug.slowdown: factor for rank {rank} must be >= 1 "
                              f"(a slowdown), got {value!r}")
        if rank in out:
            raise ConfigError(f"debug.slowdown names rank {rank} twice")
        out[rank] = factor
    return out


class SlowdownInjector:
    """Sleeps after each step so this rank runs `factor` times slower in wall time."""

    def __init__(self, factor: float = 1.0, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.perf_counter):
        if not (math.isfinite(factor) and factor >= 1.0):
            raise ConfigError(f"slowdown factor must be >= 1, got {factor!r}")
        self.factor = float(factor)
        self._sleep = sleep
        self._clock = clock
        self._debt = 0.0
        self._owed_since_flush = 0.0
        self._recent: list[float] = []
        self.injected_s = 0.0

    @property
    def active(self) -> bool:
        return self.factor > 1.0

    def owe(self, compute_s: float) -> None:
        """Add a step's extra time to the debt without sleeping yet (see `flush`).

        The extra time is (factor - 1) x the step's *unslowed* cost, estimated as the fastest of
        the recent steps: a step right after a sleep runs slower on a VM (cold caches, vCPU
        wake-up), and multiplying that inflation by the factor would overshoot it."""
        if self.active and compute_s > 0:
            self._recent = (self._recent + [compute_s])[-32:]
            extra = (self.factor - 1.0) * min(self._recent)
            self._debt += extra
            self._owed_since_flush += extra

    def flush(self) -> float:
        """Sleep off the debt; returns the seconds actually slept.

        Owing per step and sleeping once per window (before a sync) keeps the steps
        back to back: on a VM, a core that wakes from a sleep runs the next step measurably
        slower (cold caches, vCPU wake-up), which would make the rank slower than `factor`.
        """
        owed, self._owed_since_flush = self._owed_since_flush, 0.0
        if self._debt <= 0:
            return 0.0
        t0 = self._clock()
        self._sleep(self._debt)
        slept = self._clock() - t0
        self._debt = max(self._debt - slept, -CREDIT_CAP * owed)
        self.injected_s += slept
        return slept

    def after_step(self, compute_s: float) -> float:
        """Sleep off this step's share of extra time; returns the seconds actually slept."""
        if not self.active or not compute_s > 0:
            return 0.0
        self.owe(compute_s)
        return self.flush()


def slowdown_for_rank(spec, rank: int, world_size: int | None = None) -> SlowdownInjector:
    """The injector for `rank` (a no-op one when the rank is not listed)."""
    return SlowdownInjector(parse_slowdown(spec, world_size).get(rank, 1.0))
