"""`policy=cadence`: work-weighted local SGD for mixed hardware.

The ElChe scheduler (`elche.py`) gives each rank local steps in proportion to its measured
speed, so a slow rank runs fewer steps and every rank reaches the sync at about the same
time; the anchor (the slowest rank's steps per window) grows until the sync costs about
`overhead_target` of the compute.
"""

from __future__ import annotations

from .elche import ElcheScheduler
from .keys import SHARED_DEFAULTS, SHARED_DOCS, integer_key, round_or_none
from .windowed import WindowedPolicy


class CadencePolicy(WindowedPolicy):
    name = "cadence"
    defaults = dict(SHARED_DEFAULTS, max_batch_diff=None)
    key_docs = dict(SHARED_DOCS, max_batch_diff="most steps per sync the fastest rank may lead the "
                    "slowest by (and move per update); 0 = lockstep; null = no bound")

    @classmethod
    def check_own_keys(cls, cfg: dict) -> dict:
        return {"max_batch_diff": integer_key("max_batch_diff", cfg["max_batch_diff"], allow_none=True)}

    @classmethod
    def build_controller(cls, cfg, world_size: int) -> ElcheScheduler:
        return ElcheScheduler(world_size, anchor=cfg["anchor"], max_anchor=cfg["max_anchor"],
                              overhead_target=cfg["overhead_target"],
                              max_batch_diff=cfg["max_batch_diff"])

    @property
    def k(self) -> int:
        return self.controller.anchor

    def planned_counts(self) -> list[int]:
        return list(self.controller.counts)

    def _observe(self, report, trimmed: bool) -> None:
        # Sync cost: the smallest of the last few, so one preempted sync on a shared node
        # does not multiply the anchor (growth is multiplicative, decay one step). A window
        # cut short by the end of the epoch would read as high overhead: no anchor update.
        cost = self.window.costs.add(report.comm_ms)
        self.controller.observe(report.ms_per_step, cost, None if trimmed else report.window_ms)

    def _controller_record(self, metrics: dict) -> dict:
        return {"anchor": metrics["anchor"], "overhead": round_or_none(metrics["overhead"]),
                "ms_per_step": metrics["ms_per_step_ema"]}
