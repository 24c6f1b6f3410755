"""Waiting for the other ranks without holding a core.

MPI libraries busy-poll inside a blocking collective (MPICH always; Open MPI unless told to
yield), so a rank that waits seconds for rank 0 (while it composes the config, builds the spec,
writes a checkpoint) spins a core all that time. Where ranks outnumber cores (CPU lanes with
threads, a laptop, a shared CI machine) that core is taken from the rank everyone waits for.
Off the step path, the waits here sleep instead: a nonblocking barrier polled with short
sleeps, after which the real collective finds every rank already there. The step's own
Allreduce keeps MPI's busy-polling, where a millisecond matters.
"""

from __future__ import annotations

import time

# a waiting rank wakes this often: far below a spec build or a checkpoint write, far above
# the cost of one MPI_Test
POLL_S = 0.002


def wait_for_all(comm, poll_s: float = POLL_S) -> None:
    """Return once every rank of `comm` has called this; sleep meanwhile, waking every
    `poll_s`. A communicator of one rank, or an object without `Ibarrier` (a test's stand-in),
    returns at once."""
    if getattr(comm, "size", 1) <= 1 or not hasattr(comm, "Ibarrier"):
        return
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll_s)


def bcast(comm, obj, root: int = 0, poll_s: float = POLL_S):
    """`comm.bcast(obj, root)` for a small object whose root may be late: the others wait
    asleep for it."""
    wait_for_all(comm, poll_s)
    return comm.bcast(obj, root=root)


def allgather(comm, obj) -> list:
    """`comm.allgather(obj)`, the early ranks asleep until the last one comes."""
    wait_for_all(comm)
    return comm.allgather(obj)
