"""Policies: how an epoch's steps become synchronised parameters.

The policies themselves, one module each, behind the interface of `base.Policy` and listed
in `registry.POLICIES`: `sync` (one gradient Allreduce per step), and the windowed policies
(`windowed`: local steps, then one fused sync) `cadence` and `asynchronous` (`policy=async`).

Their pure math, which touches no MPI, files or clocks. Every decision is a deterministic function of numbers that come out of the one
fused Allreduce, so all ranks reach the same decision without an extra collective:

- `consensus`: the work-weighted parameter average (weigh, divide, divergence), on the
  payload and weight slot `sync_slots.SyncLayout` hands it.
- `sync_slots`: the sync's slots, `[w*W ... | w | per-rank report slots]`, in the worker's
  fused bucket, and their readout.
- `elche`: the cadence scheduler (steps per rank per window, anchor tuning).
- `interval`: the async interval controller (K from comm overhead, divergence guard).
- `outer`: outer optimizers applied to the consensus (average, DiLoCo, SlowMo).
- `window`: trimming a window's step counts to what is left of the epoch.
- `config`: `validate_policy_config`, checking `policy.*` against the selected policy's
  own declaration of its keys and defaults.
- `epochlog`: the per-epoch metrics record of a windowed policy.
"""

from .config import POLICY_NAMES, build_controller, validate_policy_config
from .consensus import work_weight
from .elche import ElcheScheduler
from .epochlog import EpochLog
from .interval import IntervalController
from .outer import DiLoCo, OuterAverage, OuterOptimizer, SlowMo, make_outer
from .smoothing import RecentMin
from .sync_slots import REPORT_FIELDS, SyncLayout, SyncReport
from .window import plan_window, stretch_to_epoch

__all__ = [
    "REPORT_FIELDS", "SyncLayout", "SyncReport",
    "POLICY_NAMES", "build_controller", "validate_policy_config", "EpochLog", "RecentMin",
    "work_weight",
    "ElcheScheduler", "IntervalController",
    "DiLoCo", "OuterAverage", "OuterOptimizer", "SlowMo", "make_outer",
    "plan_window", "stretch_to_epoch",
]
