"""Where ranks run: host names, ranks per node, a rank's index on its node, rank ranges.

No collective here but the shared-memory split of `node_layout`; the launchers' variables
are read as a fallback only.
"""

from __future__ import annotations

import os
import socket


def hostname() -> str:
    return socket.gethostname().split(".")[0]


def cores_available() -> int:
    """The cores this process may run on (its CPU affinity: a cgroup, a launcher's binding)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def rank_span(ranks) -> str:
    """[5, 0, 1, 2, 7, 8] -> "0-2,5,7-8"; no ranks -> "none". The one rank-range format of
    every message and report."""
    ranks = sorted(ranks)
    if not ranks:
        return "none"
    parts, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(parts)


# (local rank, ranks on the node) as each launcher sets them: Open MPI, MPICH's hydra, other
# PMI launchers, then Slurm last, since mpirun inside one srun task inherits a stale
# SLURM_LOCALID=0 on every rank while the inner launcher's own variables are right.
LOCAL_RANK_ENV = (("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                  ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
                  ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE"),
                  ("SLURM_LOCALID", None))


def layout_from_env(env) -> tuple[int, int] | None:
    """(local rank, ranks on the node) from the launcher's variables, or None without any. A
    missing or bad node size becomes local rank + 1 (at least this many)."""
    for rank_var, size_var in LOCAL_RANK_ENV:
        try:
            local = int(env[rank_var])
        except (KeyError, ValueError):
            continue
        try:
            size = int(env[size_var]) if size_var else 0
        except (KeyError, ValueError):
            size = 0
        return local, max(size, local + 1)
    return None


def node_layout(comm) -> tuple[int, int]:
    """(this rank's index among the ranks on its node, ranks on the node).

    From an MPI shared-memory split, which counts the processes that really share the node;
    the launcher's variables (`LOCAL_RANK_ENV`) only when the split fails.
    Collective: every rank of `comm` must call it.
    """
    try:
        from mpi4py import MPI
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        try:
            return int(node.rank), int(node.size)
        finally:
            node.Free()
    except Exception:  # noqa: BLE001 - fall back to what the launcher says
        return layout_from_env(os.environ) or (0, 1)


def local_rank(comm) -> int:
    """This rank's index among the ranks on its node (collective, see `node_layout`)."""
    return node_layout(comm)[0]


def ranks_per_node(comm) -> int:
    return node_layout(comm)[1]
