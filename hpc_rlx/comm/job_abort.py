"""Taking the whole MPI job down from one rank: the one way hpc_rlx aborts."""

from __future__ import annotations

import os
import sys
import threading
import time


def abort_job(comm, code: int, message: str | None = None) -> None:
    """Print `message` (if any), then MPI_Abort every rank of `comm`. Never returns."""
    if message:
        sys.stderr.write(message.rstrip() + "\n")
        sys.stderr.flush()
    sys.stdout.flush()
    # If MPI_Abort itself hangs, leaving by force still makes the launcher end the job.
    threading.Timer(10.0, lambda: os._exit(code)).start()
    # The launcher forwards output through a pipe; aborting at once sometimes loses the one
    # line that says what went wrong.
    time.sleep(0.5)
    comm.Abort(code)
    # MPICH's MPI_Abort can return before the launcher kills this process: nothing after it
    # may run (no second report, no Hydra traceback), so leave right here.
    os._exit(code)
