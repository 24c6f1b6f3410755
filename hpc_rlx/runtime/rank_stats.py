"""What one rank did over the run, gathered to rank 0 once at the end (summary.json `ranks`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class RankStats:
    lanes: list
    inventory: list
    samples: int = 0
    compute_s: float = 0.0
    comm_s: float = 0.0
    data_s: float = 0.0
    first_loss: float | None = None
    last_loss: float | None = None
    lane_samples: dict = field(default_factory=dict)
    lane_busy_s: dict = field(default_factory=dict)
    threads: int | None = None
    checkpoint_s: float = 0.0
    wire_bytes: int = 0             # bytes this rank sent (FusedBucket.sent; docs/observe.md)
    # one record per epoch of this rank's time split (gathered once, at the end of the run)
    epochs: list = field(default_factory=list)

    def __post_init__(self):
        self._ckpt_pending_s = 0.0             # checkpoint time inside the epoch being trained
        self._cpu_mark = time.process_time()

    def report(self) -> dict:
        """The fields gathered to rank 0."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def start_clock(self, cpu_mark: float) -> None:
        """CPU time counts from `cpu_mark` (`time.process_time()` before the data load)."""
        self._cpu_mark = cpu_mark

    def add_step(self, result) -> None:
        """A `policies.base.StepResult`: this rank's own samples, times and losses."""
        self.samples += result.rank_samples
        self.compute_s += result.compute_s
        self.comm_s += result.comm_s
        if result.rank_samples:
            if self.first_loss is None:
                self.first_loss = result.rank_loss
            self.last_loss = result.rank_loss

    def add_checkpoint(self, seconds: float, epoch: int) -> None:
        self.checkpoint_s += seconds
        if self.epochs and self.epochs[-1]["epoch"] == epoch:
            # saved after the epoch's record was made (end of epoch): belongs to that epoch
            self.epochs[-1]["checkpoint_s"] += seconds
            self.epochs[-1]["epoch_s"] += seconds
        else:
            self._ckpt_pending_s += seconds   # inside an epoch: already part of its wall time

    def record_epoch(self, epoch: int, totals, wall: float, eval_s: float, load_s: float,
                     wire_bytes: int = 0) -> None:
        """This rank's time split of epoch `epoch` (1-based); `load_s`: the shard load, which
        precedes the first epoch recorded; `wire_bytes`: what it sent in the epoch."""
        self.wire_bytes += int(wire_bytes)
        load_s = load_s if not self.epochs else 0.0
        ckpt, self._ckpt_pending_s = self._ckpt_pending_s, 0.0
        # CPU seconds of all this process's threads since the last record (MPI spin-waits
        # included): far below wall x threads means the rank did not get its cores
        cpu_now = time.process_time()
        cpu, self._cpu_mark = cpu_now - self._cpu_mark, cpu_now
        self.epochs.append({
            "epoch": epoch, "steps": totals.steps,
            "compute_s": totals.compute_s, "comm_s": totals.comm_s,
            "data_s": load_s + totals.data_s, "eval_s": eval_s, "checkpoint_s": ckpt,
            "epoch_s": load_s + wall + eval_s, "cpu_s": cpu, "wire_bytes": int(wire_bytes),
        })
