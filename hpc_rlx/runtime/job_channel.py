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

Under MPI's fault tolerance (comm.on_failure=shrink|spare) a rank may die after its job's last
collective, while the word is on its way: the survivors shrink past it and the word is sent
again (by the survivors' rank 0 if the sender died: the job was over, so its word is 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hpc_rlx.comm import idle_wait
from hpc_rlx.resilience import ulfm
from hpc_rlx.resilience.ulfm import current

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
            while not self._word((_END, int(code)))[0]:
                pass        # a rank died on the way: sent again to the survivors

    def others_left(self) -> None:
        """A job ended on every rank at once: nobody is waiting for a word any more."""
        self.open = False

    # ---- the other ranks ------------------------------------------------------------------
    def follow(self, run: Callable[[Job], object]) -> int:
        """Run each job rank 0 announces, in order; returns the exit status it sends last."""
        while True:
            sent, word = self._word(None)
            if not sent:
                continue
            if word is None:        # the sender died with its word: the survivors' rank 0 ends it
                comm = current(self.comm)
                if comm.rank == 0:
                    self._word((_END, 0))
                    return 0
                continue
            kind, value = word
            if kind == _END:
                return value
            run(value)
            comm = current(self.comm)
            if comm is not self.comm and comm.rank == 0:
                # the rank that ran Hydra died during the job (comm.on_failure=shrink): no job
                # follows; this rank, the survivors' rank 0 now, tells the others the end
                idle_wait.bcast(comm, (_END, 0), root=0, poll_s=FOLLOW_POLL_S)
                return 0

    def _word(self, word):
        """(True, rank 0's word) over the current communicator; (False, None) where a rank died
        during it and the survivors shrank past it, (True, None) where rank 0 itself died."""
        comm = current(self.comm)
        try:
            return True, idle_wait.bcast(comm, word, root=0, poll_s=FOLLOW_POLL_S)
        except Exception as exc:
            if not ulfm.failure_known(exc, comm):
                raise
            shrunk = ulfm.shrink(comm)
            return (0 in shrunk.failed), None
