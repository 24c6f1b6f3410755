"""The async averaging interval K: local steps between syncs, tuned from measurements.

Overhead rule. With `c` the slowest ms per local step and `s` the sync cost, each the mean of
the last `HISTORY` syncs, a window of K steps spends `s / (K c)` of its compute time
communicating.
The smallest K that keeps this at or below `overhead_target` is `ceil(s / (target * c))`.
K jumps up to it at once when the overhead is too high; it comes down only when that K is
more than 5% below the current one, so noise does not make it twitch (a wider deadband
keeps K high after a spike and the share settles below the target). Computing K from the
cost model, rather than nudging it by one per sync, settles in a couple of syncs.

Why a plain mean: the share that matters is summed cost over summed compute, so K must follow
the MEAN cost, spikes included, but not chase each one. An adaptive EMA (which passes big
changes through at once) lifted K at every cost spike and let it down only slowly, which kept
the measured share well below the target on a busy node.

Divergence guard. At every sync the max over ranks of `||W_i - W|| / ||W||` is compared with
`divergence_threshold`. Above it, K is halved (min 1) and a ceiling is set there, so the
overhead rule cannot undo the cut at the next sync. The ceiling relaxes by 25% per sync
whose divergence is below half the threshold, and holds in between (AIMD, as in congestion
control). K never exceeds `max_anchor`.

With `tune=False` K stays at the anchor: the costs are still measured and reported, nothing
moves K (a fixed interval, as in DiLoCo's fixed H local steps).

Inputs are the numbers every rank reads from the sync bucket (`SyncReport.comm_ms`,
max of `ms_per_step`, `max_divergence`), so all ranks get the same K.
"""

from __future__ import annotations

import math

from hpc_rlx.base.checks import OPEN_UNIT, Check, at_least

from .smoothing import valid_time

SHRINK_DEADBAND = 0.05
HISTORY = 8
CEILING_RECOVERY = 1.25


class IntervalController:
    def __init__(self, k: int = 10, max_anchor: int = 200, overhead_target: float = 0.10,
                 divergence_threshold: float | None = 0.05, tune: bool = True):
        at_least(1)("policy.anchor (initial K)", k)
        at_least(1)("policy.max_anchor", max_anchor)
        OPEN_UNIT("policy.overhead_target", overhead_target)
        Check(lambda v: v is None or (isinstance(v, (int, float)) and v > 0),
              "must be > 0 or null (guard off)")("policy.divergence_threshold", divergence_threshold)
        self.tune = bool(tune)
        self.max_anchor = int(max_anchor)
        self.overhead_target = float(overhead_target)
        self.divergence_threshold = (None if divergence_threshold is None
                                     else float(divergence_threshold))
        self.k = min(int(k), self.max_anchor)
        self.ceiling = self.max_anchor
        self.comm_hist: list[float] = []
        self.step_hist: list[float] = []
        self.trips = 0
        self.last_divergence: float | None = None

    @property
    def comm_ms(self) -> float | None:
        """Mean sync cost over the recent syncs (None before one is measured)."""
        return sum(self.comm_hist) / len(self.comm_hist) if self.comm_hist else None

    @property
    def step_ms(self) -> float | None:
        """Mean slowest ms per local step over the recent syncs."""
        return sum(self.step_hist) / len(self.step_hist) if self.step_hist else None

    @property
    def overhead(self) -> float | None:
        """Predicted comm / compute at the current K (None until both are measured)."""
        if self.comm_ms is None or self.step_ms is None:
            return None
        return self.comm_ms / (self.k * self.step_ms)

    def observe(self, comm_ms: float | None, ms_per_step: float | None,
                divergence: float | None = None) -> int:
        """One sync's measurements in; the K for the next window out.

        `comm_ms`: Allreduce cost (None before the first timed sync). `ms_per_step`: the
        slowest rank's ms per local step. `divergence`: max over ranks of the relative
        divergence (None when not measured).
        """
        if comm_ms is not None and math.isfinite(comm_ms) and comm_ms >= 0:
            self.comm_hist = (self.comm_hist + [float(comm_ms)])[-HISTORY:]
        if valid_time(ms_per_step):
            self.step_hist = (self.step_hist + [float(ms_per_step)])[-HISTORY:]
        if not self.tune:
            if divergence is not None:
                self.last_divergence = float(divergence)
            return self.k
        tripped = self._guard(divergence)
        if not tripped:
            self._tune()
        self.k = max(1, min(self.k, self.ceiling, self.max_anchor))
        return self.k

    def _guard(self, divergence: float | None) -> bool:
        if divergence is None or self.divergence_threshold is None:
            return False
        d = float(divergence)
        self.last_divergence = d
        if math.isnan(d) or d > self.divergence_threshold:
            self.ceiling = max(1, self.k // 2)
            self.k = self.ceiling
            self.trips += 1
            return True
        if d < self.divergence_threshold / 2:
            self.ceiling = min(self.max_anchor, math.ceil(self.ceiling * CEILING_RECOVERY))
        return False

    def _tune(self) -> None:
        comm, step = self.comm_ms, self.step_ms
        if comm is None or step is None:
            return
        needed = max(1, math.ceil(comm / (self.overhead_target * step)))
        if needed > self.k or needed < (1 - SHRINK_DEADBAND) * self.k:
            self.k = needed

    def metrics(self) -> dict:
        """What to log for this sync (metrics.jsonl)."""
        return {"k": self.k, "k_ceiling": self.ceiling, "overhead": self.overhead,
                "divergence": self.last_divergence, "divergence_trips": self.trips}

    def state_dict(self) -> dict:
        return {
            "k": self.k,
            "ceiling": self.ceiling,
            "max_anchor": self.max_anchor,
            "overhead_target": self.overhead_target,
            "divergence_threshold": self.divergence_threshold,
            "comm_hist": list(self.comm_hist),
            "step_hist": list(self.step_hist),
            "trips": self.trips,
            "last_divergence": self.last_divergence,
        }

    def load_state_dict(self, state: dict) -> None:
        # the knobs of the resumed config win; the learned values come from the checkpoint
        self.ceiling = min(int(state["ceiling"]), self.max_anchor)
        self.k = max(1, min(int(state["k"]), self.ceiling))
        self.comm_hist = [float(v) for v in state.get("comm_hist", [])][-HISTORY:]
        self.step_hist = [float(v) for v in state.get("step_hist", [])][-HISTORY:]
        self.trips = int(state.get("trips", 0))
        self.last_divergence = _opt_float(state.get("last_divergence"))


def _opt_float(x) -> float | None:
    return None if x is None else float(x)
