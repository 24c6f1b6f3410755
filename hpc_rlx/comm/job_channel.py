"""Rank 0 runs Hydra; the other ranks follow its jobs.

Only rank 0 needs the composed config: it builds the TrainSpec and broadcasts it. Were every
rank to run Hydra too, each would import it, read the ~20 YAML files of `configs/` and compose
twice (Hydra composes once to learn the mode, once to run): about half a second of CPU per
rank, and at a thousand ranks a burst of metadata reads on the parallel filesystem, all for a
config the rank then ignores. So the other ranks wait, asleep, for rank 0's word: the run
directory of each job Hydra starts (one per sweep point, in order), then the exit status once
Hydra is done.

A job that ends every rank (an error all ranks agree on, a Ctrl-C served with a checkpoint)
ends the followers' loop on their side too: rank 0 then sends nothing more (`others_left`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hpc_rlx.comm import idle_wait
from hpc_rlx.comm.ulfm import current

_JOB, _END = "job", "end"
# The followers wait out rank 0's whole Hydra start (a second or more): waking every 20 ms
# instead of idle_wait's 2 ms costs nothing noticeable there and a tenth of the wake-ups.
FOLLOW_POLL_S = 0.02


@dataclass(frozen=True)
class Job:
    """What a following rank needs of a job Hydra started on rank 0."""
    run_dir: str
    multirun: bool


class JobChannel:
    """Rank 0 announces jobs and the end; every other rank `follow`s. MPI_COMM_WORLD, or the
    survivors' communicator that replaced it after a dead rank (`ulfm.current`)."""

    def __init__(self, comm):
        self.comm = comm
        self.open = comm.size > 1 and comm.rank == 0    # others wait for a word from rank 0

    # ---- rank 0 -------------------------------------------------------------------------
    def start(self, job: Job) -> None:
        if self.open:
            idle_wait.bcast(current(self.comm), (_JOB, job), root=0, poll_s=FOLLOW_POLL_S)

    def end(self, code: int) -> None:
        """The last word: the others exit with `code`. Sent at most once."""
        if self.open:
            self.open = False
            idle_wait.bcast(current(self.comm), (_END, int(code)), root=0, poll_s=FOLLOW_POLL_S)

    def others_left(self) -> None:
        """A job ended on every rank at once: nobody is waiting for a word any more."""
        self.open = False

    # ---- the other ranks ------------------------------------------------------------------
    def follow(self, run: Callable[[Job], object]) -> int:
        """Run each job rank 0 announces, in order; returns the exit status it sends last."""
        while True:
            kind, value = idle_wait.bcast(current(self.comm), None, root=0, poll_s=FOLLOW_POLL_S)
            if kind == _END:
                return value
            run(value)
            comm = current(self.comm)
            if comm is not self.comm and comm.rank == 0:
                # the rank that ran Hydra died during the job (comm.on_failure=shrink): no job
                # follows; this rank, the survivors' rank 0 now, tells the others the end
                idle_wait.bcast(comm, (_END, 0), root=0, poll_s=FOLLOW_POLL_S)
                return 0
