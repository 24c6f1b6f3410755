"""What the pytest-xdist workers of one test run share: a directory per kind of artifact (ONNX
exports, prepared datasets), and a lock so that one worker makes each file while the others wait
for it, instead of every worker making its own."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


def run_dir(tmp_path_factory, name: str) -> Path:
    """`<the run's base temp>/<name>`: under pytest-xdist each worker's base temp directory lies in
    one directory of the run (as pytest-xdist documents), so all workers get the same folder;
    without xdist it is this process's own. Never shared between runs."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = root / f"shared-{name}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def exclusive(lock_path: Path):
    """Hold an exclusive flock on `lock_path` (made if missing) for the block."""
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class MachineShare:
    """Lets a test that measures wall time run with no other xdist worker's test beside it.

    Every test holds a shared flock on `<folder>/machine.lock` while it runs; a `timing` test
    holds it exclusively. A second lock, the turnstile, gives the timing test priority: it takes
    the turnstile before waiting, and every other test passes through the turnstile before taking
    its shared lock, so no new test starts while a timing test waits for the running ones."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self._turnstile = folder / "turnstile.lock"
        self._machine = folder / "machine.lock"

    @contextlib.contextmanager
    def hold(self, alone: bool):
        with open(self._turnstile, "a") as turnstile, open(self._machine, "a") as machine:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            try:
                fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            finally:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
            try:
                yield
            finally:
                fcntl.flock(machine, fcntl.LOCK_UN)
