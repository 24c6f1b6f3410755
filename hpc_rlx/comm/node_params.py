"""`comm.node_shared_params=true`: one copy of the parameters per node (with `comm.shard=optimizer`).

Under `policy=sync` every data-parallel rank holds the same parameters after each step, so the
ranks of a node can all read them from one array in an MPI-3 shared window (allocated whole by
the node's first rank). Each rank steps its own slice of the sharded state (`shard.ParamShard`)
and writes the result into the node's array in place; then, per step:

1. node barrier: every slice of this node is written;
2. across nodes, the nodes' first ranks exchange what their nodes wrote (one Allgatherv per
   round of `ParamShard.rounds`, each node's pieces packed in rank order);
3. node barrier: no rank reads the array before the pieces from other nodes are in.

No rank writes its next slice while another still reads the parameters of this step: the
next write follows the next step's reduce-scatter, which every rank of the job must enter
first. Writes from outside the step (initial weights, a resume) go through `write_all`.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.comm.reduce import mpi_module
from hpc_rlx.comm.wire_volume import allgatherv_bytes


class NodeSharedParams:
    """The node's parameter array (`array`: every rank's view of the same memory)."""

    def __init__(self, node, leaders, window, size: int, dtype, node_ranks: list[list[int]] | None):
        self.node, self.leaders, self.window = node, leaders, window
        self.array = np.frombuffer(window.Shared_query(0)[0], dtype=np.dtype(dtype), count=int(size))
        self.is_leader = node.rank == 0
        # leaders only: the global ranks of every node, in the leaders' order
        self.node_ranks = node_ranks

    @classmethod
    def create(cls, comm, size: int, dtype) -> "NodeSharedParams":
        """Collective over `comm`: the node's window of `size` values."""
        mpi = mpi_module()
        node = comm.Split_type(mpi.COMM_TYPE_SHARED, key=comm.rank)
        itemsize = np.dtype(dtype).itemsize
        # the node's first rank allocates the whole array; the others attach to it
        window = mpi.Win.Allocate_shared(int(size) * itemsize if node.rank == 0 else 0, itemsize, comm=node)
        mine = node.allgather(comm.rank)
        color = 0 if node.rank == 0 else mpi.UNDEFINED
        leaders = comm.Split(color=color, key=comm.rank)   # global rank 0 is the leaders' rank 0
        node_ranks = leaders.allgather(mine) if node.rank == 0 else None
        return cls(node, leaders, window, size, dtype, node_ranks)

    @property
    def nodes(self) -> int:
        return len(self.node_ranks) if self.node_ranks is not None else 0

    def write_all(self, comm, values=None) -> None:
        """Collective: the array becomes `values`, given on global rank 0 (which leads its
        node; ignored elsewhere): the initial weights."""
        if self.is_leader:
            if comm.rank == 0:
                self.array[...] = values
            self.leaders.Bcast(self.array, root=0)
        self.node.Barrier()

    def write_local(self, values) -> None:
        """Collective over the node: the array becomes `values`, which every rank holds."""
        if self.is_leader:
            self.array[...] = values
        self.node.Barrier()

    def allgather(self, shard, chunk_elems: int) -> int:
        """Collective: after every rank wrote its slice (`shard`'s bounds) into `array`, every
        node holds every slice. Returns the bytes this rank sent: a leader's in MPI's
        Allgatherv, computed as a ring's (`wire_volume.allgatherv_bytes`); the node's other
        ranks send nothing."""
        sent = 0
        self.node.Barrier()
        if self.is_leader and self.nodes > 1:
            for pieces in shard.rounds(chunk_elems):
                # node k's contribution: its ranks' pieces of this round, back to back
                per_node = [[pieces[r] for r in ranks] for ranks in self.node_ranks]
                counts = [sum(hi - lo for lo, hi in mine) for mine in per_node]
                offsets = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(int).tolist()
                me = self.leaders.rank
                packed = np.empty(sum(counts), dtype=self.array.dtype)
                at = offsets[me]
                for lo, hi in per_node[me]:
                    packed[at: at + hi - lo] = self.array[lo:hi]
                    at += hi - lo
                self.leaders.Allgatherv(mpi_module().IN_PLACE, [packed, (counts, offsets)])
                sent += allgatherv_bytes([c * packed.itemsize for c in counts], me)
                for k, mine in enumerate(per_node):
                    if k == me:
                        continue
                    at = offsets[k]
                    for lo, hi in mine:
                        self.array[lo:hi] = packed[at: at + hi - lo]
                        at += hi - lo
        self.node.Barrier()
        return sent

    def free(self) -> None:
        """Collective over the node: views of `array` must not be used after this."""
        self.window.Free()
        if self.leaders != mpi_module().COMM_NULL:
            self.leaders.Free()
        self.node.Free()
