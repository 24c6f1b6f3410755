"""Rank 0's live view of a run: log lines, the progress bar or lines, steps.jsonl and the
TensorBoard event files. Every rank holds one; only rank 0's shows or writes anything."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


from hpc_rlx.base import run_dir_names as names
from hpc_rlx.observe import tensorboard_log
from hpc_rlx.config.tensorboard_setting import enabled as tensorboard_enabled
from hpc_rlx.observe.metrics import Window, shown
from hpc_rlx.observe.metrics.validation import VAL_KEYS
from hpc_rlx.observe.progress import Snapshot, make_progress, run_fraction
from hpc_rlx.observe.step_log import StepLog


# Rank 0's log in the run directory: Hydra's job log (hydra.job.name is hpc_rlx in
# configs/config.yaml), which gets Python `logging` records, and every line the run prints:
# names.RUN_LOG.


def append_run_log(run_dir: str | Path, line: str) -> None:
    """One timestamped line in the run directory's log; a directory that is gone (a run removed
    before training) or unwritable costs the log line, never the run."""
    try:
        with open(Path(run_dir) / names.RUN_LOG, "a") as f:
            f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {line}\n")
    except OSError:
        pass


@dataclass(frozen=True)
class Where:
    """Where the epoch is, in the policy's terms (the loop asks the policy; `Run._where`)."""
    epoch_fraction: float      # of the epoch trained
    step_label: str            # e.g. "step 5/22" or "sync 3"
    lr: float | None           # the learning rate of the last step


class RunDisplay:
    def __init__(self, spec, is_root: bool, t_start: float):
        self.spec, self.is_root, self.t_start = spec, is_root, t_start
        self.progress = (make_progress(spec.train["progress"], spec.train["log_every_s"])
                         if is_root else None)
        self.step_log: StepLog | None = None
        self._epoch_clock = self._run_clock = None     # (time, fraction) where they started

    def log(self, msg: str) -> None:
        if not self.is_root:
            return
        if self.progress is not None:
            self.progress.print(f"[hpc_rlx] {msg}")     # above the bar, if there is one
        else:
            print(f"[hpc_rlx] {msg}", flush=True)
        append_run_log(self.spec.run_dir, f"[hpc_rlx] {msg}")

    def open_step_log(self, steps_per_epoch: int, resumed_step: int | None) -> None:
        """Rank 0: steps.jsonl, and the TensorBoard event files when report.tensorboard is on."""
        spec = self.spec
        board = None
        if tensorboard_enabled(spec.report["tensorboard"]):
            board = tensorboard_log.TensorBoardLog(spec.run_dir, tensorboard_log.flat_hparams(
                config_dict(spec), spec.world_size))
        self.step_log = StepLog(spec.run_dir, steps_per_epoch, self.t_start, board,
                                resumed_step=resumed_step)

    def epoch_start(self, worker, where: "Where", totals) -> None:
        """An epoch (or the rest of a resumed one) starts: the clocks the ETAs run from."""
        if not self.is_root:
            return
        now = time.perf_counter()
        frac = where.epoch_fraction
        self._epoch_clock = (now, frac)
        if self._run_clock is None:
            epochs = int(self.spec.train["epochs"])
            self._run_clock = (now, run_fraction(worker.epoch, frac, epochs, worker.step, worker.total_steps))
        if self.step_log is not None:
            self.step_log.epoch_start(worker.step, now, totals.counts())

    def after_step(self, worker, totals, where: Callable[[], "Where"]) -> None:
        """Rank 0 after a step: the step log and the progress display, from global totals."""
        if self.progress is None:
            return
        now = time.perf_counter()
        show, log = self.progress.due(now), self.step_log
        if not show and (log is None or not log.due(worker.step, now)):
            return          # most steps: nothing to write or draw
        at = where()
        frac, lr, counts = min(1.0, at.epoch_fraction), at.lr, totals.counts()
        if log is not None:
            log.step(worker.step, now, counts, worker.epoch + frac, lr)
        if not show:
            return
        epochs = int(self.spec.train["epochs"])
        self.progress.update(Snapshot(
            epoch=worker.epoch, epochs=epochs, epoch_fraction=frac,
            run_fraction=run_fraction(worker.epoch, frac, epochs, worker.step, worker.total_steps),
            step=worker.step, step_label=at.step_label, epoch_samples=totals.samples,
            samples_per_epoch=int(worker.plan.samples_per_epoch),
            shown=shown(Window(counts, seconds=now - self._epoch_clock[0], lr=lr,
                               per_sample=worker.per_sample)), now=now,
            epoch_t0=self._epoch_clock[0], epoch_f0=self._epoch_clock[1],
            run_t0=self._run_clock[0], run_f0=self._run_clock[1]))

    def epoch_end(self, rec: dict, comm_s: float, steps: int, partial: bool) -> None:
        """The epoch's record: into the step log, and one line above the (closed) bar."""
        if self.step_log is not None:
            self.step_log.epoch(rec)
        if self.progress is not None:
            self.progress.end_epoch()
        acc = "".join(f"  {k} {fmt(rec[k])}" for k in VAL_KEYS[1:] if k in rec)   # what the model reports
        part = f" (partial: {steps} steps)" if partial else ""
        self.log(f"epoch {rec['epoch']}/{self.spec.train['epochs']}{part}  train_loss {fmt(rec['train_loss'])}  "
                 f"val_loss {fmt(rec['val_loss'])}{acc}  "
                 f"{fmt(rec['samples_per_s'], 0)} samples/s  comm {fmt(comm_s, 3)}s")

    def event(self, rec: dict) -> None:
        """Rank 0: a run event (`{"event": ...}`) where the steps are recorded (TensorBoard)."""
        if self.step_log is not None:
            self.step_log.event(rec)

    def close(self) -> None:
        """End the progress bar and the step log (also when the run fails)."""
        if self.progress is not None:
            self.progress.close()
        if self.step_log is not None:
            self.step_log.close()


def config_dict(spec) -> dict:
    """The resolved config as a dict (the hyper-parameters TensorBoard shows)."""
    try:
        import yaml   # here: the ranks other than 0 never parse YAML
        cfg = yaml.safe_load(spec.config_yaml or "") or {}
    except yaml.YAMLError:
        cfg = {}
    if not isinstance(cfg, dict) or not cfg:
        cfg = {"train": dict(spec.train), "optim": dict(spec.optim), "policy": dict(spec.policy),
               "device": dict(spec.device), "comm": dict(spec.comm)}
    return cfg


def fmt(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}"
