"""Everything MPI: collective error agreement, spec/array broadcast, the fused bucket and abort.

Idioms: lowercase `bcast`/`allgather` only for small Python objects (the spec, status
strings); uppercase buffer collectives for arrays, so arrays are never pickled.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from typing import Any, Callable, Sequence

import numpy as np

from . import trace
from .errors import HpcRlxError


def world():
    """The MPI world communicator (imports and initialises MPI on first call)."""
    from mpi4py import MPI
    return MPI.COMM_WORLD


def hostname() -> str:
    return socket.gethostname().split(".")[0]


# --------------------------------------------------------------------------------------
# Errors decided collectively: every rank raises the same message, nobody is left waiting.
# --------------------------------------------------------------------------------------

class CollectiveError(HpcRlxError):
    """A user-facing error agreed by all ranks. `origin` is the rank that first hit it."""

    def __init__(self, message: str, kind: str = "HpcRlxError", origin: int = 0):
        super().__init__(message)
        self.kind = kind
        self.origin = origin


def _status(exc: BaseException | None) -> tuple | None:
    if exc is None:
        return None
    if isinstance(exc, CollectiveError):
        return (exc.kind, str(exc))
    if isinstance(exc, HpcRlxError):
        return (type(exc).__name__, str(exc))
    # A bug, not bad input: keep the traceback so it can be fixed.
    return (type(exc).__name__, "".join(traceback.format_exception(exc)).rstrip())


def agree(comm, fn: Callable[[], Any]) -> Any:
    """Run `fn` on every rank; if it fails anywhere, every rank raises the same error.

    The lowest failing rank's message wins, so the message is identical everywhere.
    """
    try:
        result, exc = fn(), None
    except Exception as e:  # noqa: BLE001 - re-raised collectively below
        result, exc = None, e
    statuses = comm.allgather(_status(exc))
    for rank, st in enumerate(statuses):
        if st is not None:
            raise CollectiveError(st[1], kind=st[0], origin=rank) from exc
    return result


def root_computes(comm, fn: Callable[[], Any], root: int = 0) -> Any:
    """Rank `root` runs `fn` and broadcasts its (small, picklable) result or its error."""
    payload = None
    if comm.rank == root:
        try:
            payload = ("ok", fn())
        except Exception as e:  # noqa: BLE001
            payload = ("err", _status(e))
    payload = comm.bcast(payload, root=root)
    if payload[0] == "err":
        kind, message = payload[1]
        raise CollectiveError(message, kind=kind, origin=root)
    return payload[1]


def bcast_array(comm, array: np.ndarray | None, root: int = 0) -> np.ndarray:
    """Broadcast a numpy array by buffer; non-root ranks pass None and receive a new array."""
    meta = comm.bcast(None if comm.rank != root else (array.shape, array.dtype.str), root=root)
    if comm.rank != root:
        array = np.empty(meta[0], dtype=np.dtype(meta[1]))
    comm.Bcast(array, root=root)
    return array


def abort(comm, message: str, code: int = 1) -> None:
    """Print one message and take the whole MPI job down (no rank may be left waiting)."""
    sys.stderr.write(message.rstrip() + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    comm.Abort(code)


# --------------------------------------------------------------------------------------
# The fused bucket
# --------------------------------------------------------------------------------------

class FusedBucket:
    """One contiguous array: [gradients or weighted params ... | tail fields].

    Lanes write gradients straight into `payload` views, the loop writes counts, loss sums
    and flags into the tail, and one in-place SUM Allreduce (chunked under the size cap)
    gives every rank the global sums of all of it at once.
    """

    def __init__(self, payload_size: int, tail_fields: Sequence[str], dtype, xp=np,
                 cap_mb: float = 16.0, deterministic: bool = False):
        self.fields = {name: i for i, name in enumerate(tail_fields)}
        self.payload_size = int(payload_size)
        self.buffer = xp.zeros(self.payload_size + len(tail_fields), dtype=dtype)
        self.payload = self.buffer[: self.payload_size]
        self.tail = self.buffer[self.payload_size:]
        itemsize = np.dtype(dtype).itemsize
        self.chunk_elems = max(1, int(cap_mb * 1024 * 1024) // itemsize)
        self.deterministic = deterministic
        self.last_chunks = 0

    def __getitem__(self, field: str) -> float:
        return float(self.tail[self.fields[field]])

    def __setitem__(self, field: str, value: float) -> None:
        self.tail[self.fields[field]] = value

    def zero_tail(self) -> None:
        self.tail[...] = 0

    def allreduce(self, comm) -> float:
        """Sum the whole bucket over all ranks in place. Returns seconds spent."""
        from mpi4py import MPI
        t0 = time.perf_counter()
        tr = trace.ACTIVE
        seq = tr.next_seq() if tr is not None else 0
        buf = self.buffer
        n = buf.shape[0]
        chunks = 0
        for lo in range(0, n, self.chunk_elems):
            part = buf[lo: lo + self.chunk_elems]
            tc = time.perf_counter()
            if self.deterministic:
                _ordered_sum(comm, part)
            else:
                comm.Allreduce(MPI.IN_PLACE, part, op=MPI.SUM)
            if tr is not None:
                tr.add("chunk", "comm", trace.MAIN, tc, time.perf_counter(),
                       {"seq": seq, "i": chunks, "bytes": int(part.nbytes)})
            chunks += 1
        self.last_chunks = chunks
        t1 = time.perf_counter()
        if tr is not None:
            tr.add("allreduce", "comm", trace.MAIN, t0, t1,
                   {"seq": seq, "bytes": int(buf.nbytes), "chunks": chunks})
        return t1 - t0


def _ordered_sum(comm, part: np.ndarray) -> None:
    """Sum in rank order on rank 0, then broadcast: bitwise reproducible for a world size."""
    gathered = np.empty((comm.size,) + part.shape, dtype=part.dtype) if comm.rank == 0 else None
    comm.Gather(np.ascontiguousarray(part), gathered, root=0)
    if comm.rank == 0:
        acc = gathered[0].copy()
        for r in range(1, comm.size):
            acc += gathered[r]
        part[...] = acc
    comm.Bcast(part, root=0)


def local_rank(comm) -> int:
    """This rank's index among the ranks on its node."""
    for var in ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK"):
        if var in os.environ:
            try:
                return int(os.environ[var])
            except ValueError:
                pass
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        return node.rank
    finally:
        node.Free()


def ranks_per_node(comm) -> int:
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        return node.size
    finally:
        node.Free()
