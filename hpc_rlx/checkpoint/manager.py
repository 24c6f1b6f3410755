"""CheckpointManager: atomic saves, keep-last plus best retention, and choosing what to resume.

Rank 0 owns one manager per run; no MPI here.

A save: temporary file in the checkpoint directory -> flush, fsync -> read back and verify ->
rename over ``ckpt-<step>.h5`` -> fsync the directory -> rewrite ``latest`` the same way ->
delete what retention no longer keeps. A kill or a full disk at any point leaves the previous
checkpoint and ``latest`` valid; retention deletes only after the new checkpoint is durable.

Resume takes the highest-step checkpoint that verifies. Resuming an older checkpoint than the
newest (resume=PATH) renames the newer ones to ``ckpt-<step>.abandoned-<time>.h5``: they stay on
disk, but neither resume=auto nor retention nor a later save at their step touches them.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from datetime import datetime, timezone
from pathlib import Path

from hpc_rlx.base.version import __version__
from hpc_rlx.checkpoint import h5file as hf
from hpc_rlx.checkpoint.h5file import (
    BEST_POINTER,
    FORMAT,
    FORMAT_VERSION,
    POINTER,
    CheckpointState,
    Warn,
    warn_stderr,
    checkpoint_name,
    read_checkpoint,
    verify_checkpoint,
)
from hpc_rlx.checkpoint.retention import (
    BestTracker,
    metric_mode,
    plan_deletions,
    record,
    usable_value,
)
from hpc_rlx.checkpoint.staged_file import StagedArrays, write_staged
from hpc_rlx.base.errors import CheckpointError, ConfigError

_DISK_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
_HISTORY_KEYS = ("metric_history", "history")  # where the training loop keeps its metric history


def _dump(obj) -> bytes:
    # insertion order is kept so meta reads back exactly as it was given
    return json.dumps(obj, ensure_ascii=False, allow_nan=True, separators=(",", ":")).encode("utf-8")


class CheckpointManager:
    """Saves checkpoints of one run into `directory` (normally ``<run_dir>/checkpoints``).

    keep_last: how many of the newest checkpoints to keep (>= 1), besides the best.
    metric, mode: the best checkpoint is the one with the lowest ("min") or highest ("max")
        metric value passed to `save`; mode None infers min for *loss and max for *accuracy.
    verify_writes: read each new file back and check its checksum before it replaces anything.
    """

    def __init__(self, directory, keep_last: int = 2, metric: str = "val_loss",
                 mode: str | None = None, verify_writes: bool = True):
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last must be an integer >= 1, got {keep_last!r}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.metric = metric
        self.mode = metric_mode(metric, mode)
        self.verify_writes = verify_writes
        self._history: list[tuple[int, float | None]] = []  # (step, metric) of kept checkpoints
        self._best = BestTracker(self.mode)
        self._previous_uid: str | None = None  # the checkpoint this run continues from

    # ------------------------------------------------------------ listing
    def path_for(self, step: int) -> Path:
        return self.directory / checkpoint_name(step)

    def steps(self) -> list[int]:
        """Steps of the checkpoint files present, ascending (only names this manager writes)."""
        try:
            entries = list(os.scandir(self.directory))
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = []
        for entry in entries:
            m = hf.CKPT_RE.fullmatch(entry.name)
            if m and entry.is_file():
                found.append(int(m.group(1)))
        return sorted(found)

    @property
    def best_step(self) -> int | None:
        return self._best.step

    @property
    def best_value(self) -> float | None:
        return self._best.value

    @property
    def best_path(self) -> Path | None:
        return None if self._best.step is None else self.path_for(self._best.step)

    # ------------------------------------------------------------ saving
    def save(self, state: CheckpointState, step: int, metric_value=None) -> Path:
        """Write checkpoint `step` atomically, point ``latest`` at it, then apply retention.

        metric_value: this checkpoint's value of `metric` (None or NaN: not a best candidate).
        Raises CheckpointError if it cannot be written; the previous checkpoint and ``latest``
        are then unchanged and no temporary file is left behind.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r}")
        # StagedArrays: written piece by piece (a pipelined run's stages), same file
        staged = state.arrays if isinstance(state.arrays, StagedArrays) else None
        arrays = staged if staged is not None else hf.check_arrays(state.arrays)
        meta = hf.normalise_meta(state.meta)
        if not isinstance(meta, dict):
            raise TypeError(f"checkpoint meta must be a dict, got {type(meta).__name__}")
        if "step" in meta and meta["step"] != step:
            raise ValueError(f"checkpoint meta says step {meta['step']!r} but it is saved as step {step}")
        if metric_value is not None and not isinstance(metric_value, (int, float)):
            metric_value = float(metric_value)  # NumPy scalars; anything else raises TypeError here
        history = record(self._history, step, metric_value)
        final = self.path_for(step)
        uid = uuid.uuid4().hex
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
            "created": datetime.now(timezone.utc).isoformat(), "uid": uid,
            "previous_uid": self._previous_uid, "hpc_rlx_version": __version__,
            "retention": {"metric": self.metric, "mode": self.mode, "keep_last": self.keep_last,
                          "history": [[s, v] for s, v in history]},
            "arrays": staged.rows() if staged is not None
            else [[name, a.dtype.str, list(a.shape)] for name, a in arrays.items()],
        }
        manifest_bytes, meta_bytes = _dump(manifest), _dump(meta)
        checksum = None if staged is not None else hf.checksum(manifest_bytes, meta_bytes, arrays)

        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"could not create checkpoint directory {self.directory}: {e}") from e
        self._remove_stale_temps()
        need = (staged.nbytes if staged is not None else sum(a.nbytes for a in arrays.values())) \
            + len(manifest_bytes) + len(meta_bytes)
        self._check_space(final, need + hf.SLACK_BYTES)

        tmp = hf.temp_name(final)
        try:
            if staged is not None:
                write_staged(tmp, manifest_bytes, meta_bytes, staged)
            else:
                hf.write_h5(tmp, manifest_bytes, meta_bytes, arrays, checksum)
            hf.fsync_file(tmp)
            if self.verify_writes:
                verify_checkpoint(tmp)
            hf.replace_file(tmp, final)
        except BaseException as e:
            hf.unlink_quiet(tmp)
            if isinstance(e, (OSError, RuntimeError, CheckpointError)):
                raise CheckpointError(self._failure(final, e)) from e
            raise
        self._previous_uid, self._history = uid, history  # the new file is complete from here on
        try:
            hf.fsync_dir(self.directory)
            hf.write_text_atomic(self.directory / POINTER, final.name + "\n")
        except OSError as e:
            raise CheckpointError(
                f"checkpoint {final} was written but the '{POINTER}' pointer could not be updated: "
                f"{e} (disk full?); resume=auto still finds it, nothing was deleted") from e

        present = set(self.steps())
        self._best.rebuild((s, v) for s, v in history if s in present)
        doomed = plan_deletions(present, step, self.keep_last, self._best.step)
        self._history = [(s, v) for s, v in history if s not in doomed]
        self._write_best_pointer()
        for s in doomed:
            try:
                os.unlink(self.path_for(s))
            except FileNotFoundError:
                pass
            except OSError as e:
                warn_stderr(f"could not delete old checkpoint {self.path_for(s)}: {e}")
        return final

    def _failure(self, final: Path, e: BaseException) -> str:
        if isinstance(e, CheckpointError):
            why = f"{e} (it read back differently from what was written: failing storage?)"
        elif isinstance(e, OSError) and e.errno is not None and e.errno not in _DISK_ERRNOS:
            why = str(e)
        else:  # HDF5 reports some write failures without an errno
            why = f"{e} (disk full or over quota?)"
        kept = self._pointer_name()
        kept = (f"the previous checkpoint {kept} and the '{POINTER}' pointer are unchanged" if kept
                else "no earlier checkpoint was affected")
        return f"could not write checkpoint {final}: {why}; {kept}"

    def _check_space(self, final: Path, need: int) -> None:
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            return
        if need > free:
            raise CheckpointError(
                f"could not write checkpoint {final}: it needs about {need / 2**20:.1f} MiB but only "
                f"{free / 2**20:.1f} MiB are free in {self.directory} (disk full?); nothing was changed")

    def _remove_stale_temps(self) -> None:
        """Temporaries left by a writer that was killed; they can be as large as a checkpoint."""
        for entry in os.scandir(self.directory):
            if hf.TMP_RE.fullmatch(entry.name) and entry.is_file():
                hf.unlink_quiet(Path(entry.path))

    def _write_best_pointer(self) -> None:
        """``best`` names the best checkpoint, for people and tools; resume never reads it."""
        if self.best_path is None:
            if (self.directory / BEST_POINTER).is_file():
                hf.unlink_quiet(self.directory / BEST_POINTER)  # it may name a checkpoint moved aside
            return
        if self._read_name(BEST_POINTER) == self.best_path.name:
            return
        try:
            hf.write_text_atomic(self.directory / BEST_POINTER, self.best_path.name + "\n")
        except OSError as e:
            warn_stderr(f"could not update {self.directory / BEST_POINTER}: {e}")

    # ------------------------------------------------------------ resuming
    def _read_name(self, pointer: str) -> str | None:
        try:
            return (self.directory / pointer).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return None

    def _pointer_name(self) -> str | None:
        return self._read_name(POINTER)

    def _resume_order(self) -> list[Path]:
        # Highest step first, not the pointer's target: a kill between the rename and the pointer
        # update leaves a complete newer checkpoint that must not be lost. Checkpoints beyond a
        # resumed one cannot mislead this because `restore_history` moves them aside.
        return [self.path_for(s) for s in reversed(self.steps())]

    def latest_valid(self, warn: Warn = warn_stderr) -> Path | None:
        """The newest checkpoint that verifies, or None; each one skipped is reported via `warn`."""
        for path in self._resume_order():
            try:
                verify_checkpoint(path)
                return path
            except CheckpointError as e:
                warn(f"skipping checkpoint {path}: {e}")
        return None

    def load_latest(self, warn: Warn = warn_stderr, arrays: bool = True) -> CheckpointState | None:
        """Like `latest_valid`, but returns the loaded state (each file is read once; arrays=False:
        verified, its arrays left in the file, see `read_checkpoint`)."""
        for path in self._resume_order():
            try:
                return read_checkpoint(path, arrays=arrays)
            except CheckpointError as e:
                warn(f"skipping checkpoint {path}: {e}")
        return None

    def restore_history(self, source, warn: Warn = warn_stderr) -> None:
        """Continue from a checkpoint (a path or a state from `read_checkpoint`).

        Call it on every resume, before training continues. It rebuilds best tracking from the
        metric values recorded in the checkpoint, so a best checkpoint older than the keep-last
        window survives the resume and goes only when a better one is saved. If the checkpoint
        lies in this directory, later checkpoints are moved aside (see `_move_aside`) and
        ``latest`` is pointed at it; from another directory, nothing here is touched.
        """
        state = source if isinstance(source, CheckpointState) else read_checkpoint(source)
        if not state.info:
            raise ValueError("restore_history needs a path or a state returned by read_checkpoint")
        where, step = state.path, int(state.info["step"])
        rec = state.info.get("retention") or {}
        if rec.get("metric") == self.metric and rec.get("mode") == self.mode:
            history = [(int(s), usable_value(v)) for s, v in rec.get("history", []) if int(s) <= step]
        else:
            history = self._history_from_meta(state.meta, step)
            warn(f"checkpoint {where} ranked checkpoints by {rec.get('metric')!r} ({rec.get('mode')}); "
                 f"now ranking by {self.metric!r} ({self.mode}) from its metric history")
        present = set(self.steps())
        same_dir = where is not None and Path(where).resolve().parent == self.directory.resolve()
        self._history = [(s, v) for s, v in history if s in present] if same_dir else []
        self._best.rebuild(self._history)
        self._previous_uid = state.info.get("uid")
        if not same_dir:
            return
        self._move_aside([s for s in sorted(present) if s > step], Path(where).name, warn)
        if self._pointer_name() != Path(where).name:
            try:
                hf.write_text_atomic(self.directory / POINTER, Path(where).name + "\n")
            except OSError as e:
                raise CheckpointError(f"could not point {self.directory / POINTER} at the resumed "
                                      f"checkpoint {Path(where).name}: {e}") from e
        self._write_best_pointer()

    def _move_aside(self, steps: list[int], resumed: str, warn: Warn) -> None:
        """Rename checkpoints beyond the resumed one out of the way, keeping their data.

        They belong to a run that went further and was then resumed from an earlier point; left
        in place, resume=auto would return to them and training would overwrite them.
        """
        if not steps:
            return
        tag = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:4]
        moved = []
        for s in steps:
            src = self.path_for(s)
            dst = self.directory / f"ckpt-{s:08d}.abandoned-{tag}.h5"
            try:
                hf.replace_file(src, dst)
            except OSError as e:
                raise CheckpointError(f"resuming from {resumed}: could not move the later checkpoint "
                                      f"{src} aside to {dst.name}: {e}") from e
            moved.append(dst.name)
        hf.fsync_dir(self.directory)
        warn(f"resuming from {resumed} in {self.directory}: later checkpoints were moved aside (kept, "
             f"never deleted by hpc_rlx): {', '.join(moved)}")

    def _history_from_meta(self, meta: dict, step: int) -> list[tuple[int, float | None]]:
        """(step, value) pairs of `metric` from the loop's metric history in meta: a list of
        dicts with "step" and metric values, under "metric_history" or "history"."""
        values: dict[int, float | None] = {}
        entries = next((meta[k] for k in _HISTORY_KEYS if isinstance(meta.get(k), list)), [])
        for entry in entries:
            if isinstance(entry, dict) and isinstance(entry.get("step"), int) and entry["step"] <= step:
                v = entry.get(self.metric)
                values[entry["step"]] = usable_value(v) if isinstance(v, (int, float)) else None
        return sorted(values.items())
