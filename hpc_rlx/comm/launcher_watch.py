"""A rank whose launcher is gone ends itself.

The launcher's process on a node (MPICH's `hydra_pmi_proxy`, Open MPI's `prted`/`prterun`,
Slurm's `slurmstepd`) is every rank's parent there, and it takes its ranks down when the job
ends: on MPI_Abort it signals them, on a dead rank it kills the others. Where that process dies
first (killed with the job's `mpirun`, or losing its own launcher), its ranks are re-parented
and nobody ends them: one blocked in a collective whose peers are gone polls for ever (a rank of
an aborted pipelined job was found running an hour after its job, with parent 1). So every rank
started by a launcher watches its parent and leaves as soon as it changes.
"""

from __future__ import annotations

import os
import sys
import threading
import time

# set in a rank's environment by the launchers hpc_rlx runs under; a process started without one
# (a singleton run, whose parent is a shell that may end under nohup) is not watched
LAUNCHED_BY = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_STEP_ID")
POLL_S = 1.0
EXIT_CODE = 1


def launched(env) -> bool:
    """Whether this process is a rank a launcher started (pure)."""
    return any(k in env for k in LAUNCHED_BY)


def watch_parent(poll_s: float = POLL_S) -> threading.Thread | None:
    """Start the watch (a daemon thread that wakes every `poll_s`); None where not launched."""
    parent = os.getppid()
    if not launched(os.environ) or parent <= 1:
        return None

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        try:    # the launcher held the other end of stderr: the line may have nowhere to go
            sys.stderr.write(f"hpc_rlx: the launcher's process of this rank (pid {parent}) is gone: the "
                             f"job is over; pid {os.getpid()} leaves\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - leaving regardless
            pass
        os._exit(EXIT_CODE)

    thread = threading.Thread(target=watch, name="hpc_rlx-launcher-watch", daemon=True)
    thread.start()
    return thread
