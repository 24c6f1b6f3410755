"""BLAS / thread-pool limits per rank, so ranks x threads never oversubscribe the cores."""

from __future__ import annotations

from threadpoolctl import threadpool_limits

from hpc_rlx.base.topology import cores_available, ranks_per_node  # noqa: F401 - cores_available re-exported


def default_threads(cores: int, ranks_on_node: int, lanes: int = 1) -> int:
    """Cores shared evenly by the ranks on this node (and the CPU lanes of each rank)."""
    return max(1, cores // max(1, ranks_on_node * max(1, lanes)))


def training_threads(threads_per_rank: int | None, cores: int, ranks_on_node: int, lanes: int = 1) -> int:
    """The BLAS threads one rank trains with: train.threads_per_rank when given, else its
    share of the cores it may use (the rule `limit_threads` applies; the doctor reports it)."""
    if threads_per_rank is not None:
        return int(threads_per_rank)
    return default_threads(cores, ranks_on_node, lanes)


def thread_lanes(cpu_lanes) -> int:
    """How many CPU lanes share a rank's cores (a GPU-only rank still has one host pool)."""
    return max(1, int(cpu_lanes or 1))


def limit_threads(comm, threads_per_rank: int | None, lanes: int = 1):
    """Apply the limit with threadpoolctl. Returns the number of threads now in force.

    The limiter object is kept alive on the module so the limit holds for the whole run.
    """


    # ranks_per_node is collective: called on every rank or on none (the setting is the same everywhere)
    on_node = ranks_per_node(comm) if threads_per_rank is None else 1
    threads_per_rank = training_threads(threads_per_rank, cores_available(), on_node, lanes)
    global _LIMITER
    _LIMITER = threadpool_limits(limits=int(threads_per_rank))
    return int(threads_per_rank)


_LIMITER = None
