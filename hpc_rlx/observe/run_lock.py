"""One job at a time in a run directory: rank 0 holds an exclusive lock on `<run_dir>/.hpc_rlx.lock`.

Two jobs writing one directory would interleave their metrics.jsonl records and overwrite each
other's checkpoints, model.h5 and `latest`; the second job is refused instead, before it writes.
The lock is `flock(2)` on an open file, so the kernel releases it when the holder exits in any
way (a killed job leaves no stale lock). The file itself stays and names its last holder.

A file system without flock (Lustre mounted without `-o flock`, some FUSE mounts) cannot lock:
the run goes on unlocked, as before this existed, and the debug log says so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from pathlib import Path

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.base.errors import ConfigError

log = logging.getLogger(__name__)

_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunDirLock:
    """Held by rank 0 while a run trains in `run_dir`; `release()` (or process exit) frees it."""

    def __init__(self, fd: int | None):
        self._fd = fd      # None: a file system without flock, nothing held

    @classmethod
    def acquire(cls, run_dir: str | Path, host: str) -> "RunDirLock":
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / names.LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read_holder(fd))
            os.close(fd)
            raise ConfigError(
                f"run directory {run_dir} is in use by another job{holder}; two jobs in one "
                f"directory would overwrite each other's checkpoints and metrics. Wait for it to "
                f"finish, or give this run its own hydra.run.dir") from None
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                os.close(fd)
                raise
            log.debug("run directory lock: %s does not support flock (%s); running unlocked", path, e)
            os.close(fd)
            return cls(None)
        record = json.dumps({"host": host, "pid": os.getpid(),
                             "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record + b"\n", 0)
        return cls(fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)     # closing the descriptor drops the flock
            self._fd = None


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return ""
    where = f" on {holder['host']}" if holder.get("host") else ""
    since = f", since {holder['since']}" if holder.get("since") else ""
    return f" (pid {holder['pid']}{where}{since})"
