"""`policy=async`: every rank runs K local steps between syncs.

The interval controller (`interval.py`) keeps the sync's mean cost near `overhead_target`
of the compute, and its divergence guard cuts K when the ranks' models drift apart. (The
module is not named `async`, a Python keyword.)
"""

from __future__ import annotations

from .interval import IntervalController
from .keys import SHARED_DEFAULTS, SHARED_DOCS, bool_key, number_key, round_or_none
from .window import stretch_to_epoch
from .windowed import WindowedPolicy


class AsyncPolicy(WindowedPolicy):
    name = "async"
    defaults = dict(SHARED_DEFAULTS, divergence_threshold=0.05, tune=True)
    key_docs = dict(SHARED_DOCS, divergence_threshold="max over ranks of ||W_i - W|| / ||W|| above "
                    "which K is halved; null = guard off",
                    tune="false: K stays at `anchor` (no overhead tuning, no divergence guard)")

    @classmethod
    def check_own_keys(cls, cfg: dict) -> dict:
        return {"divergence_threshold": number_key("divergence_threshold", cfg["divergence_threshold"],
                                                   allow_none=True),
                "tune": bool_key("tune", cfg["tune"])}

    @classmethod
    def build_controller(cls, cfg, world_size: int) -> IntervalController:
        return IntervalController(k=cfg["anchor"], max_anchor=cfg["max_anchor"],
                                  overhead_target=cfg["overhead_target"],
                                  divergence_threshold=cfg["divergence_threshold"], tune=cfg["tune"])

    @property
    def k(self) -> int:
        return self.controller.k

    def planned_counts(self) -> list[int]:
        # K, stretched so the epoch's windows come out even (see stretch_to_epoch)
        left = self.window.samples_left() // max(1, sum(self.window.batches))
        # untuned (policy.tune=false): exactly the anchor, the epoch's last window may be shorter
        cap = (min(self.controller.ceiling, self.controller.max_anchor) if self.controller.tune
               else self.controller.k)
        return [stretch_to_epoch(self.controller.k, left, cap)] * self.world

    def window_k(self, planned: list[int]) -> int:
        return planned[0]

    def _observe(self, report, trimmed: bool) -> None:
        # async aims the MEAN share at the target, so it takes every cost, spikes included
        # (the controller averages the recent ones)
        self.controller.observe(report.comm_ms, report.slowest_ms_per_step, report.max_divergence)

    def _controller_record(self, metrics: dict) -> dict:
        return {"overhead": round_or_none(metrics["overhead"]), "k_ceiling": metrics["k_ceiling"],
                "divergence_trips": metrics["divergence_trips"]}
