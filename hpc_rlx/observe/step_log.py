"""Per-step training records at a bounded rate: `RUN_DIR/steps.jsonl` (rank 0).

One line per recorded step: `step` (global), `epoch` (fractional position, e.g. 1.5 = half way
through the second epoch), `loss` (mean training loss of the global samples since the previous
record), `lr`, `samples_per_s` (over the wall time since the previous record) and `time_s`.
`python -m hpc_rlx.report` draws the curves of short runs from it; the same records go to
TensorBoard (`tensorboard_log`) when that is on.

The rate is bounded two ways (`StepSampler`): at most `MAX_PER_EPOCH` records per epoch and a
minimum time between two: `MIN_INTERVAL_S` for steps.jsonl (a line costs ~5 us) and
`TENSORBOARD_INTERVAL_S` for TensorBoard (an event costs ~150 us in tensorboardX's queue), so
recording stays under ~0.5% of the step time however short the steps are.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from hpc_rlx import run_dir_names as names

MAX_PER_EPOCH = 100
MIN_INTERVAL_S = 0.002
TENSORBOARD_INTERVAL_S = 0.1


class StepSampler:
    """Which steps to record, and the aggregates since the last record (pure)."""

    def __init__(self, steps_per_epoch: int, max_per_epoch: int = MAX_PER_EPOCH,
                 min_interval_s: float = MIN_INTERVAL_S):
        self.stride = max(1, math.ceil(int(steps_per_epoch) / max_per_epoch))
        self.min_interval_s = float(min_interval_s)
        self._mark: tuple | None = None       # (step, time, samples, loss_sum) of the last record
        # the time of the last record, kept across epochs: with epochs shorter than the
        # interval, a rule reset at every epoch start would record nothing at all
        self._last_record_t = -math.inf

    def start(self, step: int, now: float, samples: float, loss_sum: float) -> None:
        """The start of an epoch (or of a run segment): the epoch's running totals so far."""
        self._mark = (int(step), float(now), float(samples), float(loss_sum))

    def due(self, step: int, now: float) -> bool:
        if self._mark is None:
            return True
        return step - self._mark[0] >= self.stride and now - self._last_record_t >= self.min_interval_s

    def add(self, step: int, now: float, samples: float, loss_sum: float) -> dict | None:
        """After a step, with the epoch's running totals: a record, or None (not this step)."""
        if self._mark is None:
            self.start(step - 1, now, 0.0, 0.0)
        if not self.due(step, now):
            return None
        step0, t0, s0, l0 = self._mark
        self._mark = (int(step), float(now), float(samples), float(loss_sum))
        self._last_record_t = float(now)
        n = samples - s0
        return {"step": int(step),
                "loss": (loss_sum - l0) / n if n > 0 else None,
                "samples_per_s": n / (now - t0) if now > t0 else None}


class StepLog:
    """steps.jsonl (and the TensorBoard writer, if any) for rank 0."""

    def __init__(self, run_dir, steps_per_epoch: int, t_start: float, tensorboard=None,
                 resumed_step: int | None = None):
        self.path = Path(run_dir) / names.STEPS
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resumed_step is not None:
            trim_after(self.path, resumed_step)
        self.file = open(self.path, "a", buffering=1 << 16)
        self.sampler = StepSampler(steps_per_epoch)
        self.board_sampler = StepSampler(steps_per_epoch, min_interval_s=TENSORBOARD_INTERVAL_S)
        self.t_start = t_start
        self.tensorboard = tensorboard

    def epoch_start(self, step: int, now: float, samples: float, loss_sum: float) -> None:
        self.sampler.start(step, now, samples, loss_sum)
        self.board_sampler.start(step, now, samples, loss_sum)

    def due(self, step: int, now: float) -> bool:
        """Whether `step` would write anything (the loop skips its work otherwise)."""
        return self.sampler.due(step, now) or (self.tensorboard is not None
                                                and self.board_sampler.due(step, now))

    def step(self, step: int, now: float, samples: float, loss_sum: float, epoch_position: float,
             lr: float | None) -> None:
        rec = self.sampler.add(step, now, samples, loss_sum)
        if rec is not None:
            rec.update(epoch=round(epoch_position, 6), lr=lr, time_s=round(now - self.t_start, 4))
            self.file.write(json.dumps(rec) + "\n")
        if self.tensorboard is not None:
            board = self.board_sampler.add(step, now, samples, loss_sum)
            if board is not None:
                self.tensorboard.step(dict(board, lr=lr))

    def epoch(self, rec: dict) -> None:
        self.file.flush()
        if self.tensorboard is not None:
            self.tensorboard.epoch(rec)

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


def trim_after(path: Path, step: int) -> None:
    """On resume, records past the checkpoint's step are trained again: drop them."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line)["step"]) <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue      # a partial last line of a killed run
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def read_steps(path) -> list[dict]:
    """The records of a steps.jsonl (a partial last line is skipped)."""
    path = Path(path)
    out = []
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
