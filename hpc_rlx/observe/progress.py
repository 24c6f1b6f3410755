"""Rank 0's progress display: a tqdm bar on an interactive terminal, plain lines otherwise.

`launcher.display_for` picks the style (train.progress=auto|bar|lines). Both styles show the
epoch's percent, elapsed time and ETA, the run's ETA, samples/s and the epoch's running
metrics that have a display label (`observe.metrics`: the loss):

- bar: one tqdm bar per epoch, redrawn at most `BAR_REDRAWS_PER_S` times a second, erased at the
  epoch's end (the epoch's summary line stays); log lines print above it;
- lines: one line after the run's first step, then one every `train.log_every_s` seconds; no
  carriage returns or escape codes, so batch logs stay clean.

The numbers come from `Snapshot`s the training loop fills in; `estimate` is the pure ETA math.
`end_line` is the one line that ends a run.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from dataclasses import dataclass

from hpc_rlx.observe.launcher import display_for
from hpc_rlx.observe.metrics.validation import VAL_KEYS

BAR_REDRAWS_PER_S = 4


@dataclass
class Snapshot:
    """Where the run is, as rank 0 sees it after a step (global numbers, from the bucket)."""
    epoch: int                 # 0-based epoch being trained
    epochs: int
    epoch_fraction: float      # of this epoch, in [0, 1]
    run_fraction: float        # of the whole run, in [0, 1]
    step: int                  # global step (syncs for windowed policies)
    step_label: str            # e.g. "step 5/22" or "sync 3"
    epoch_samples: float       # samples trained so far in this epoch
    samples_per_epoch: int
    shown: tuple               # (label, value) of the epoch's running metrics (`metrics.shown`)
    now: float
    epoch_t0: float            # when this epoch (or its resumed part) started, and how far it was
    epoch_f0: float
    run_t0: float              # when training started in this process, and the run's fraction then
    run_f0: float

    @property
    def epoch_eta(self) -> float | None:
        return estimate(self.now - self.epoch_t0, self.epoch_fraction, self.epoch_f0)

    @property
    def run_eta(self) -> float | None:
        return estimate(self.now - self.run_t0, self.run_fraction, self.run_f0)


def estimate(elapsed: float, fraction: float, start_fraction: float) -> float | None:
    """Seconds left when `elapsed` seconds took the work from `start_fraction` to `fraction`
    (a resumed run starts part-way); None until there is something to extrapolate from."""
    done = fraction - start_fraction
    if elapsed <= 0 or done <= 0:
        return None
    return max(0.0, elapsed * (1.0 - fraction) / done)


def run_fraction(epoch: int, epoch_fraction: float, epochs: int, step: int,
                 total_steps: int | None) -> float:
    """Fraction of the run done: by epochs, or by train.max_steps when that ends it sooner."""
    by_epochs = (epoch + epoch_fraction) / max(1, epochs)
    if total_steps:
        return min(1.0, max(by_epochs, step / total_steps))
    return min(1.0, by_epochs)


def sig(v, digits: int = 4) -> str:
    """A number with `digits` significant digits (losses), '-' for none."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "-"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.{digits}g}"


def duration(seconds: float | None) -> str:
    """`42s`, `3m05s`, `1h02m`; '?' when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def rate(samples_per_s: float | None) -> str:
    if samples_per_s is None or not math.isfinite(samples_per_s):
        return "? samples/s"
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if samples_per_s >= scale:
            return f"{samples_per_s / scale:.3g}{unit} samples/s"
    return f"{samples_per_s:.3g} samples/s"


END_WORDS = {"completed": "completed", "max_steps": "stopped at train.max_steps",
             "signal": "stopped by a signal (checkpoint written)", "nonfinite": "failed (non-finite values)"}


def end_line(status: str, wall_s: float, final: dict | None, run_dir: str, detail: str = "") -> str:
    """The run's last line: status, wall time, final metrics and the run directory."""
    final = final or {}
    words = END_WORDS.get(status, status)
    metrics = "  ".join(f"{k} {sig(final[k])}" for k in ("train_loss", *VAL_KEYS)
                        if isinstance(final.get(k), (int, float)))
    where = f"epoch {final['epoch']}{' (partial)' if final.get('partial') else ''}, " \
            f"step {final['step']}: " if "epoch" in final and "step" in final else ""
    parts = [f"{words} in {duration(wall_s)}"]
    if detail:
        parts.append(detail)
    return (f"{'; '.join(parts)}; {where}{metrics or 'no metrics'}; run directory {run_dir}")


class Progress:
    """Common part; `print` writes a log line without breaking the display."""

    def __init__(self, out=None, log_every_s: float = 10.0):
        self.out = out or sys.stdout
        self.log_every_s = log_every_s

    def print(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def due(self, now: float) -> bool:
        """Whether an update now would show anything: the loop builds a Snapshot only then,
        so a step costs one comparison when nothing is drawn."""
        raise NotImplementedError

    def update(self, s: Snapshot) -> None:
        raise NotImplementedError

    def end_epoch(self) -> None:
        pass

    def close(self) -> None:
        pass


class LineProgress(Progress):
    """Plain lines: the first after the first step, then every `log_every_s` seconds."""

    def __init__(self, out=None, log_every_s: float = 10.0):
        super().__init__(out, log_every_s)
        self._last: float | None = None
        self._last_samples = 0.0

    def due(self, now: float) -> bool:
        return self._last is None or now - self._last >= self.log_every_s

    def update(self, s: Snapshot) -> None:
        total = s.epoch * s.samples_per_epoch + s.epoch_samples      # samples over the run
        if self._last is None:      # the run's first line: the rate since the epoch started
            since, samples = s.now - s.epoch_t0, s.epoch_samples - s.epoch_f0 * s.samples_per_epoch
        elif not self.due(s.now):
            return
        else:
            since, samples = s.now - self._last, total - self._last_samples
        self._last, self._last_samples = s.now, total
        self.print(format_line(s, samples / since if since > 0 else None))


def format_line(s: Snapshot, samples_per_s: float | None) -> str:
    return (f"[hpc_rlx] epoch {s.epoch + 1}/{s.epochs} {100 * s.epoch_fraction:3.0f}% "
            f"({s.step_label}, global step {s.step})  "
            f"{shown_text(s.shown, '  ')}{rate(samples_per_s)}  "
            f"ETA epoch {duration(s.epoch_eta)}, run {duration(s.run_eta)}")


def shown_text(shown, separator: str) -> str:
    """`label value` of each shown metric, each followed by `separator`."""
    return "".join(f"{label} {sig(value)}{separator}" for label, value in shown)


class BarProgress(Progress):
    """A tqdm bar per epoch, in samples, redrawn at most BAR_REDRAWS_PER_S times a second."""

    def __init__(self, out=None, log_every_s: float = 10.0):
        super().__init__(out, log_every_s)
        self._bar = None
        self._last_draw = 0.0

    def _open(self, s: Snapshot) -> None:
        from tqdm import tqdm
        tqdm.monitor_interval = 0          # no monitor thread next to MPI
        self._bar = tqdm(total=s.samples_per_epoch, initial=int(s.epoch_samples), file=self.out,
                         desc=f"epoch {s.epoch + 1}/{s.epochs}", unit=" samples", unit_scale=True,
                         leave=False, mininterval=1.0 / BAR_REDRAWS_PER_S, **_width(self.out),
                         smoothing=0.1,
                         bar_format="{desc} {percentage:3.0f}%|{bar}| {elapsed}<{remaining} "
                                    "{rate_fmt}{postfix}")

    def due(self, now: float) -> bool:
        return self._bar is None or now - self._last_draw >= 1.0 / BAR_REDRAWS_PER_S

    def update(self, s: Snapshot) -> None:
        if self._bar is None:
            self._open(s)
        bar = self._bar
        self._last_draw = s.now
        bar.set_postfix_str(f"{s.step_label}, {shown_text(s.shown, ', ')}run ETA {duration(s.run_eta)}",
                            refresh=False)
        delta = int(s.epoch_samples) - bar.n
        if delta > 0:
            bar.update(delta)      # tqdm redraws (its mininterval is the same period)

    def print(self, line: str) -> None:
        if self._bar is None:
            super().print(line)
            return
        self._bar.clear()
        super().print(line)
        self._bar.refresh()

    def end_epoch(self) -> None:
        if self._bar is not None:
            self._bar.close()       # leave=False: erased; the epoch's summary line follows
            self._bar = None

    def close(self) -> None:
        self.end_epoch()


def _width(out) -> dict:
    """tqdm's width: follow the terminal when `out` is one that reports a size; otherwise (a
    rank's pipe under mpirun, a terminal of size 0, where tqdm would draw nothing) $COLUMNS or
    100 columns."""
    try:
        if os.get_terminal_size(out.fileno()).columns > 0:
            return {"dynamic_ncols": True}
    except (AttributeError, OSError, ValueError):
        pass
    size = shutil.get_terminal_size((100, 24))
    return {"ncols": size.columns, "nrows": max(size.lines, 2)}


def make_progress(mode: str, log_every_s, out=None) -> Progress:
    """The display for train.progress=MODE on this process (rank 0)."""
    period = 10.0 if log_every_s is None else float(log_every_s)
    style = display_for(mode, out or sys.stdout)
    if style == "bar":
        try:
            import tqdm  # noqa: F401
        except ImportError:
            style = "lines"       # a minimal install: plain lines still say everything
    return (BarProgress if style == "bar" else LineProgress)(out, period)
