"""The bucket's sum through memory the ranks of a node share (``comm.shared_memory``).

Each rank's bucket lives in its own segment of one MPI-3 shared window per node, so the lanes
write their gradients where every rank of the node can read them. One sum is then:

1. node barrier: every segment holds this step's values;
2. each of the L ranks of a node owns 1/L of the bucket and adds the other ranks' parts of it
   into its own segment, in rank order (no message, no copy into MPI's buffers);
3. with several nodes, the owners of the same part on every node Allreduce it (MPI, chunked
   under ``comm.bucket_cap_mb``): L such Allreduces of 1/L of the bytes run side by side,
   one per local rank, as a hierarchical Allreduce does;
4. node barrier: every part is final in its owner's segment;
5. each rank copies the other parts from their owners' segments into its own;
6. node barrier: no rank's next step overwrites its segment while another still copies.

Within one node every value is computed once, by its owner, in a fixed order, so all ranks hold
the same bits (and a run repeats bitwise for a given placement). Against MPICH's Allreduce on 2
ranks of one node: 0.34-0.77x its time for 1-32 MiB buckets, about equal at 64 MiB, where both
are bound by memory bandwidth (`bench/bench_collective.py`, `bench/README.md`).

Only where every rank can take part (`refusal`): a host bucket on CPU-only lanes, every node
with the same number of ranks, room in ``/dev/shm`` for the node's segments. Elsewhere the
bucket keeps MPI's Allreduce (`reduce.HostSum`), and the start-up line says why.
"""

from __future__ import annotations

import os

import numpy as np

from hpc_rlx.comm.reduce import HostSum, Reduced, ReductionPath, mpi_module

SHM_DIR = "/dev/shm"
SHM_HEADROOM = 1.25      # the node's segments must fit /dev/shm's free space with this margin


def owned_parts(n: int, ranks: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into ``ranks`` contiguous parts, one per rank of a node (pure)."""
    return [(r * n // ranks, (r + 1) * n // ranks) for r in range(ranks)]


def largest_shared_bucket(free_bytes: int, node_ranks: int) -> int:
    """The largest bucket (bytes per rank) the node's shared-memory sum takes with
    ``free_bytes`` free in /dev/shm and ``node_ranks`` ranks on the node (pure)."""
    return int(free_bytes / SHM_HEADROOM / max(1, node_ranks))


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int | None:
    """Free bytes in ``shm_dir``, or None where it cannot be measured."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def shm_shortfall(node_bytes: int, shm_dir: str = SHM_DIR) -> str | None:
    """None where ``node_bytes`` (every segment of the node) fits the free space of ``shm_dir``
    with the headroom, else why not, in words. A container's /dev/shm is often 64 MiB: a window
    larger than it would die of SIGBUS on first touch instead of failing to allocate."""
    free = shm_free_bytes(shm_dir)
    if free is None:
        return None          # no /dev/shm to measure: the MPI library places the window itself
    if node_bytes * SHM_HEADROOM <= free:
        return None
    mib = 1024 * 1024
    return (f"{shm_dir} has {free / mib:.1f} MiB free, the node's segments need "
            f"{node_bytes * SHM_HEADROOM / mib:.1f} MiB ({node_bytes / mib:.1f} MiB and "
            f"{SHM_HEADROOM - 1:.0%} headroom)")


# Windows still open in this process. A run's window outlives the run (views of the bucket,
# such as a windowed policy's, stay valid); the next `create` frees the ones before it, so a
# sweep of many runs in one process holds at most one at a time. MPI_Finalize takes the last.
_OPEN: list[NodeSharedSum] = []
# Windows left behind after a failure (`abandon`): never freed, kept so their memory stays mapped.
_ABANDONED: list[NodeSharedSum] = []


class NodeSharedSum(ReductionPath):
    """A reduction path (see `hpc_rlx.comm.reduce`) over a node's shared window. Build it with
    `NodeSharedSum.create` (collective), then hand `segment` to the bucket as its buffer."""

    in_node_memory = True

    def __init__(self, node, cross, window, memories: list, size: int, dtype, chunk_elems: int):
        self.node, self.cross, self.window = node, cross, window
        self.communicators = (node, cross)
        # the other ranks' segments as raw memory, viewed as arrays only while summing: this
        # rank holds one bucket-sized array, its own
        self._memories, self._size, self._dtype = memories, int(size), np.dtype(dtype)
        self.segment = self._view(node.rank)
        self.parts = owned_parts(self._size, node.size)
        self.before_free = None      # a weak callback: the bucket moves off the segment first
        self.chunk_elems = int(chunk_elems)
        self.across_nodes = HostSum(chunk_elems)    # this rank's part, chunked, over `cross`
        nodes = cross.size
        self.path = (f"node shared memory ({node.size} ranks)" if nodes == 1 else
                     f"node shared memory ({node.size} ranks per node), MPI across {nodes} nodes")

    # ---- setup ---------------------------------------------------------------------------
    @staticmethod
    def refusal(comm, node_ranks: int, why_not: str | None, node_bytes: int) -> str | None:
        """Collective: None where every rank can share (CPU-only, more than one rank on every
        node, the same number on each, room for the node's segments), else why not, the same
        words on every rank (the first rank's reason, with its number unless all agree)."""
        why = why_not or ("one rank on its node" if node_ranks == 1 else shm_shortfall(node_bytes))
        views = comm.allgather((why, int(node_ranks)))
        reasons = [reason for reason, _ in views]
        for rank, reason in enumerate(reasons):
            if reason:
                return reason if len(set(reasons)) == 1 else f"rank {rank}: {reason}"
        counts = sorted({n for _, n in views})
        if len(counts) > 1:
            return f"nodes hold different numbers of ranks ({', '.join(map(str, counts))})"
        return None

    @classmethod
    def create(cls, comm, size: int, dtype, chunk_elems: int,
               why_not: str | None = None) -> tuple[NodeSharedSum | None, str | None]:
        """Collective over ``comm``: (the node's window of one ``size``-element segment per
        rank, None), or (None, why not) on every rank when some rank cannot share (see
        `refusal`; ``why_not``: this rank's own reason, e.g. a GPU lane)."""
        mpi = mpi_module()
        cls.free_open()
        node = comm.Split_type(mpi.COMM_TYPE_SHARED, key=comm.rank)
        itemsize = np.dtype(dtype).itemsize
        why = cls.refusal(comm, node.size, why_not, size * itemsize * node.size)
        if why is not None:
            node.Free()
            return None, why
        # ranks with the same index on their node: they sum the same part across nodes
        cross = comm.Split(color=node.rank, key=comm.rank)
        info = mpi.Info.Create()
        info.Set("alloc_shared_noncontig", "true")   # each segment on its owner's NUMA node
        window = mpi.Win.Allocate_shared(size * itemsize, itemsize, info=info, comm=node)
        info.Free()
        memories = [window.Shared_query(r)[0] for r in range(node.size)]
        shared = cls(node, cross, window, memories, size, dtype, chunk_elems)
        shared.segment[...] = 0
        node.Barrier()
        _OPEN.append(shared)
        return shared, None

    def _view(self, rank: int) -> np.ndarray:
        return np.frombuffer(self._memories[rank], dtype=self._dtype, count=self._size)

    @staticmethod
    def free_open() -> None:
        """Collective: free every window this process still holds (each rank holds the same
        ones: every rank of a job creates one, or none)."""
        while _OPEN:
            _OPEN.pop().free()

    def free(self) -> None:
        """Collective over the node: release the window and the communicators. Views of the
        segment (the bucket's) must not be used after this."""
        if self in _OPEN:
            _OPEN.remove(self)
        leave = self.before_free() if self.before_free is not None else None
        if leave is not None:
            leave()
        self._memories = []
        self.window.Free()
        self.cross.Free()
        self.node.Free()

    def abandon(self) -> None:
        """After a rank of the job died (ULFM): revoke the node's and the cross-node
        communicators, so that no rank stays waiting in their barriers or sums, and keep the
        window unfreed for the rest of the process (freeing it is collective over a node that
        lost a rank, and may hang). This rank's segment stays valid memory."""
        if self in _OPEN:
            _OPEN.remove(self)
        _ABANDONED.append(self)
        for comm in (self.node, self.cross):
            try:
                comm.Revoke()
            except Exception:  # noqa: BLE001 - already revoked, or no ULFM: nothing waits on it
                pass

    # ---- one sum ---------------------------------------------------------------------------
    def run(self, bucket, comm, seq: int) -> Reduced:
        if bucket.buffer is not self.segment:
            raise RuntimeError("the bucket's buffer is not this rank's shared segment")
        node, me = self.node, self.node.rank
        lo, hi = self.parts[me]
        node.Barrier()
        own = self.segment[lo:hi]
        peers = [self._view(r) for r in range(node.size)]
        for r, seg in enumerate(peers):               # rank order: the same sum every step
            if r != me:
                own += seg[lo:hi]
        chunks, sent = 1, 0
        if self.cross.size > 1:
            done = self.across_nodes.sum_array(self.cross, own, seq)
            chunks, sent = done.chunks, done.wire_bytes
        node.Barrier()
        for r, (a, b) in enumerate(self.parts):
            if r != me:
                self.segment[a:b] = peers[r][a:b]
        node.Barrier()
        return Reduced(chunks, sent, self.path)
