"""No process outlives its job: every process a test starts carries the test's mark in its
environment (tests/conftest.py sets it for the test's body), and after the body the harness
looks for the test's launchers and ranks still alive (/proc), kills them, and fails the test
that left them. A leak then fails where it happened instead of slowing every later test."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

MARK = "HPC_RLX_TEST_JOB"
# what a job's processes run: its launcher and daemons, or a rank (python -m hpc_rlx or a script
# of tests/support); a test's other helpers (a Slurm cluster's daemons) are left alone
JOB_PROGRAMS = ("mpirun", "mpiexec", "prterun", "prted", "hydra_pmi_proxy", "hpc_rlx", "tests/support",
                "python")
# a job that just ended may still be taking its ranks down
GRACE_S = 10.0


def new_mark() -> str:
    return uuid.uuid4().hex


def _marked(mark: str) -> list[tuple[int, str]]:
    """(pid, command line) of this machine's processes whose environment holds `mark`."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            if needle not in environ.split(b"\0"):
                continue
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if cmdline and any(p in cmdline for p in JOB_PROGRAMS):
            found.append((int(proc.name), cmdline))
    return found


def left_behind(mark: str, grace_s: float = GRACE_S) -> list[tuple[int, str]]:
    """The test's job processes still alive after `grace_s`; each is killed before this returns."""
    deadline = time.monotonic() + grace_s
    alive = _marked(mark)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = _marked(mark)
    for pid, _ in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return alive
