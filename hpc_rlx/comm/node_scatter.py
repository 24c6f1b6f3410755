"""`comm.shard=optimizer` with ``comm.shared_memory``: the bucket's reduce-scatter, and the
parameters' allgather, through the node's shared memory, with MPI only between nodes.

The bucket lives in the rank's segment of the node's shared window, as for `node_memory`'s sum.
Rank k of a node shares a column with rank k of every other node (`NodeSharedSum`'s cross
communicator); a column's slices (`shard.ParamShard`, one per member) are what its members
exchange across nodes. One reduce-scatter is then:

1. node barrier: every segment holds this step's gradients;
2. each rank adds, in node-rank order, every segment's copy of its column's slices and of the
   tail (counts, loss, flags), into scratch memory of its own;
3. node barrier: nobody reads a segment any more;
4. with several nodes, the column exchanges those node sums (one Alltoallv per round of
   `ParamShard.rounds`, the tail in the first) and each member adds the nodes' sums of its
   own slice, in node order;
5. each rank writes its slice's sum and the tail's into its own segment.

On one node step 4 is empty: no message and two barriers, where `shard.ScatteredSum` takes an
Allgather of the tail and an Alltoallv of the payload over every rank. With two ranks on a core
every blocking collective waits for a rank the scheduler has not run yet. Across nodes only
1/L of the payload leaves a node's rank (L ranks per node), as in `node_memory`'s hierarchical
sum, where `ScatteredSum` sends (N - 1)/N of it over the whole job.

The parameters' allgather (`gather_params`) runs the other way: the column's Allgather
across nodes, then each rank copies its column's slices into its own segment (the step's
gradients are spent by then), a node barrier, each rank copies the other columns' slices out
of their owners' segments, and a node barrier before the next step's backward overwrites them.

On one node the sums are `ScatteredSum`'s additions in the same order, so the two paths give
the same bits. Across nodes the order is node by node, so under ``comm.deterministic`` the
sharded sum keeps `ScatteredSum` there (rank order), and the start-up line says why.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.comm.node_memory import NodeSharedSum
from hpc_rlx.comm.reduce import Reduced
from hpc_rlx.comm.shard import allgather_pieces


class NodeScatteredSum(NodeSharedSum):
    """The sharded bucket's reduce-scatter in the node's shared window, column by column
    across nodes; it also gathers the parameters (`gathers_params`)."""

    gathers_params = True

    def attach(self, comm, shard, layout, shared_params=None) -> None:
        """Collective over ``comm``: the slices every rank owns (`ParamShard`) and where the
        payload and the tail sit in a segment (`bucket_layout.BucketLayout`); with
        ``comm.node_shared_params``, the node's parameter array (`node_params.NodeSharedParams`),
        which then gathers the parameters instead of the segments."""
        self.shard, self.layout, self.shared_params = shard, layout, shared_params
        nodes = self.cross.size
        self.path = (f"node shared memory ({self.node.size} ranks)" if nodes == 1 else
                     f"node shared memory ({self.node.size} ranks per node), reduce-scatter across {nodes} nodes")
        self._start = layout.payload_start
        self._tail = slice(layout.tail_start, layout.tail_start + layout.tail_size)
        # columns[k]: the ranks (of `comm`) that are rank k of their node, in cross-rank order
        place = comm.allgather((self.node.rank, self.cross.rank))
        self._columns = [[g for _, g in sorted((place[g][1], g) for g in range(comm.size) if place[g][0] == k)]
                         for k in range(self.node.size)]
        column = self._columns[self.node.rank]
        self._rounds = [[pieces[g] for g in column] for pieces in shard.rounds(self.chunk_elems)]

    def _node_sums(self, peers: list, tail_size: int) -> list[np.ndarray]:
        """Per round: for each member of this rank's column, the tail (first round only) and
        that member's piece, each summed over this node's segments in node-rank order."""
        tail = peers[0][self._tail].copy()
        for seg in peers[1:]:
            tail += seg[self._tail]
        start, rounds = self._start, []
        for r, pieces in enumerate(self._rounds):
            head = tail_size if r == 0 else 0
            packed = np.empty(sum(head + b - a for a, b in pieces), dtype=tail.dtype)
            at = 0
            for a, b in pieces:
                packed[at: at + head] = tail
                at += head
                out = packed[at: at + b - a]
                out[...] = peers[0][start + a: start + b]
                for seg in peers[1:]:
                    out += seg[start + a: start + b]
                at += b - a
            rounds.append(packed)
        return rounds

    def run(self, bucket, comm, seq: int) -> Reduced:
        if bucket.buffer is not self.segment:
            raise RuntimeError("the bucket's buffer is not this rank's shared segment")
        node, cross, me = self.node, self.cross, self.cross.rank
        tail_size, start = self._tail.stop - self._tail.start, self._start
        node.Barrier()
        packed = self._node_sums([self._view(r) for r in range(node.size)], tail_size)
        node.Barrier()
        sent = 0
        for r, (pieces, send) in enumerate(zip(self._rounds, packed)):
            head = tail_size if r == 0 else 0
            counts = [head + b - a for a, b in pieces]
            if cross.size > 1:      # the nodes' sums of this rank's piece, in node order
                mine = counts[me]
                recv = np.empty(mine * cross.size, dtype=send.dtype)
                offsets = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(int).tolist()
                cross.Alltoallv([send, (counts, offsets)],
                                [recv, ([mine] * cross.size, [mine * k for k in range(cross.size)])])
                rows = recv.reshape(cross.size, mine)
                total = rows[0].copy()
                for k in range(1, cross.size):
                    total += rows[k]
                sent += (sum(counts) - mine) * send.itemsize
            else:
                total = send
            lo, hi = pieces[me]
            if head:
                self.segment[self._tail] = total[:head]
            self.segment[start + lo: start + hi] = total[head:]
        return Reduced(len(self._rounds), sent, self.path)

    def gather_params(self, comm, params: np.ndarray) -> int:
        """Every rank's updated slice of `params` to every rank, in place: across nodes within
        the column (MPI), then within the node through the segments (or the node's parameter
        array's own allgather). Returns the bytes sent."""
        if self.shared_params is not None:
            return self.shared_params.allgather(self.shard, self.chunk_elems)
        sent = allgather_pieces(self.cross, params, self._rounds) if self.cross.size > 1 else 0
        node, start = self.node, self._start
        for pieces in self._rounds:
            for a, b in pieces:
                self.segment[start + a: start + b] = params[a:b]
        node.Barrier()
        for k in range(node.size):
            if k != node.rank:
                seg = self._view(k)
                for a, b in self._column_spans(k):
                    params[a:b] = seg[start + a: start + b]
        node.Barrier()          # the next step's backward overwrites the segments
        return sent

    def _column_spans(self, k: int) -> list[tuple[int, int]]:
        """The slices of node rank k's column (its members' `ParamShard` bounds)."""
        return [self.shard.bounds[g] for g in self._columns[k]]
