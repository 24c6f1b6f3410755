"""Per-step training records at a bounded rate: `RUN_DIR/steps.jsonl` (rank 0).

One line per recorded step: `step` (global), the metrics with a step key (`observe.metrics`:
`loss`, the mean training loss of the global samples since the previous record; `lr`;
`samples_per_s`, over the wall time since the previous record), `epoch` (fractional position,
e.g. 1.5 = half way through the second epoch) and `time_s`.
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

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.observe.metrics import Window, step_values

MAX_PER_EPOCH = 100
MIN_INTERVAL_S = 0.002
TENSORBOARD_INTERVAL_S = 0.1


class StepSampler:
    """Which steps to record, and the counts since the last record (pure)."""

    def __init__(self, steps_per_epoch: int, max_per_epoch: int = MAX_PER_EPOCH,
                 min_interval_s: float = MIN_INTERVAL_S):
        self.stride = max(1, math.ceil(int(steps_per_epoch) / max_per_epoch))
        self.min_interval_s = float(min_interval_s)
        self._mark: tuple | None = None       # (step, time, counts) of the last record
        # the time of the last record, kept across epochs: with epochs shorter than the
        # interval, a rule reset at every epoch start would record nothing at all
        self._last_record_t = -math.inf

    def start(self, step: int, now: float, counts: dict) -> None:
        """The start of an epoch (or of a run segment): the epoch's running counts so far."""
        self._mark = (int(step), float(now), dict(counts))

    def due(self, step: int, now: float) -> bool:
        if self._mark is None:
            return True
        return step - self._mark[0] >= self.stride and now - self._last_record_t >= self.min_interval_s

    def add(self, step: int, now: float, counts: dict, lr: float | None = None) -> Window | None:
        """After a step, with the epoch's running counts: the window since the last record,
        or None (not this step)."""
        if self._mark is None:
            self.start(step - 1, now, {})
        if not self.due(step, now):
            return None
        _, t0, before = self._mark
        self._mark = (int(step), float(now), dict(counts))
        self._last_record_t = float(now)
        since = {key: value - before.get(key, 0.0) for key, value in counts.items()}
        return Window(since, seconds=now - t0, lr=lr)


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

    def epoch_start(self, step: int, now: float, counts: dict) -> None:
        self.sampler.start(step, now, counts)
        self.board_sampler.start(step, now, counts)

    def due(self, step: int, now: float) -> bool:
        """Whether `step` would write anything (the loop skips its work otherwise)."""
        return self.sampler.due(step, now) or (self.tensorboard is not None
                                                and self.board_sampler.due(step, now))

    def step(self, step: int, now: float, counts: dict, epoch_position: float,
             lr: float | None) -> None:
        window = self.sampler.add(step, now, counts, lr)
        if window is not None:
            rec = {"step": int(step), **step_values(window), "epoch": round(epoch_position, 6),
                   "time_s": round(now - self.t_start, 4)}
            self.file.write(json.dumps(rec) + "\n")
        if self.tensorboard is not None:
            board = self.board_sampler.add(step, now, counts, lr)
            if board is not None:
                self.tensorboard.step(int(step), step_values(board))

    def epoch(self, rec: dict) -> None:
        self.file.flush()
        if self.tensorboard is not None:
            self.tensorboard.epoch(rec)

    def event(self, rec: dict) -> None:
        """A run event (a failure): steps.jsonl carries none, TensorBoard marks it."""
        if self.tensorboard is not None:
            self.tensorboard.event(rec)

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
