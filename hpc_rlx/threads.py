"""BLAS / thread-pool limits per rank, so ranks x threads never oversubscribe the cores."""

from __future__ import annotations

import os


def default_threads(cores: int, ranks_on_node: int, lanes: int = 1) -> int:
    """Cores shared evenly by the ranks on this node (and the CPU lanes of each rank)."""
    return max(1, cores // max(1, ranks_on_node * max(1, lanes)))


def cores_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def limit_threads(comm, threads_per_rank: int | None, lanes: int = 1):
    """Apply the limit with threadpoolctl. Returns the number of threads now in force.

    The limiter object is kept alive on the module so the limit holds for the whole run.
    """
    from threadpoolctl import threadpool_limits

    from .comm import ranks_per_node

    if threads_per_rank is None:
        threads_per_rank = default_threads(cores_available(), ranks_per_node(comm), lanes)
    global _LIMITER
    _LIMITER = threadpool_limits(limits=int(threads_per_rank))
    return int(threads_per_rank)


_LIMITER = None
